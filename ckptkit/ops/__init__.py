"""The library calls behind the commands: :func:`~.convert.convert` and :func:`~.convert.reshard`,
:func:`~.export.export_hf`, :func:`~.verify.verify` and :func:`~.inspect.inspect`, and the ``ckptkit.json``
checksums of :mod:`.checksums`. The rest serves them: the model-part rule (:mod:`.select`), wrapper-name
stripping (:mod:`.names`), key renames and the model families' tables (:mod:`.mapping`, :mod:`.tables`,
:mod:`.presets`, :mod:`.adapter`, :mod:`.detect`), what ``config.json`` says (:mod:`.hfconfig`), and the
files an HF export carries (:mod:`.assets`)."""
