"""``bin/bench``: ckptkit against ``cp`` of the same bytes and against the path users take without it, on
synthetic checkpoints. One subcommand per mode (:mod:`.cli`):

- ``shapes``: the checkpoints' names and shapes, and the writers that lay them out;
- ``runner``: each contender a process of its own, timed and its peak RSS taken, rows interleaved, the page cache
  warm or full;
- ``table``: the tables printed, with each row's ratio to its baseline;
- ``convert``, ``save``, ``targets``, ``inprocess`` (``chunks``, ``metadata``), ``storage`` (``s3``): the modes.
"""
