"""The file formats ckptkit reads and writes by hand, as data and without torch: ``torch.save`` archives
(:mod:`.torchzip_read`, :mod:`.torchzip_write`), pickles through an allow-list (:mod:`.pickle_read`) and
their writer (:mod:`.pickle_write`), DCP's ``.metadata`` (:mod:`.dcp_metadata`), FSDP1's ShardedTensor and
torch's DTensor pickles (:mod:`.sharded_tensor`, :mod:`.dtensor`), and safetensors headers
(:mod:`.safetensors_header`). Every reader treats its input as untrusted: offsets are checked, and what torch
would refuse is refused."""
