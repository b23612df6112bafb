"""Real multi-rank runs that check ckptkit against torch: a small transformer (:mod:`.model`) trained under
plain, DDP, FSDP1 and FSDP2 wrappers and saved or loaded in each format (:mod:`.training`, :mod:`.configs`,
:mod:`.states`, :mod:`.staged`), ranks launched over gloo or NCCL (:mod:`.launch`), and the matrix of save,
convert and reload cells (:mod:`.matrix`, :mod:`.runner`) judged on bit-exact state and resumed losses
(:mod:`.checks`, :mod:`.control`), behind ``ckptkit harness`` (:mod:`.cli`)."""
