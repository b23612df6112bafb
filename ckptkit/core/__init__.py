"""The pure core every other package builds on, with no I/O and no torch: the :class:`~.manifest.Manifest`
that every format reads into and writes from (:mod:`.manifest`), dtypes as plain data (:mod:`.dtypes`), box
and chunk arithmetic (:mod:`.boxes`, :mod:`.reshape`), write plans and their byte ranges (:mod:`.plan`,
:mod:`.split`), nested state dicts flattened as DCP flattens them (:mod:`.tree`), and the garbage-collector
pause for building large descriptions (:mod:`.gc_pause`)."""
