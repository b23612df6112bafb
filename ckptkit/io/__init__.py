"""Moving bytes: where checkpoints are read and written (:mod:`.storage`, the one seam to local files, object
stores and memory), the source reader (:mod:`.sources`), the executor that streams a write plan into a storage
(:mod:`.execute`), its workers and torchrun ranks (:mod:`.parallel`), the
options every write shares (:mod:`.options`) and the progress bar (:mod:`.progress`)."""
