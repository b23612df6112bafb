"""The library calls behind the commands: :func:`~.convert.convert` and :func:`~.convert.reshard`,
:func:`~.export.export_hf`, :func:`~.verify.verify` and :func:`~.inspect.inspect`, and the ``ckptkit.json``
checksums of :mod:`.checksums`. The rest serves them: the model-part rule (:mod:`.select`), the model layer's
use by a command (:mod:`._model`; the families themselves are :mod:`ckptkit.models`), and the files an HF
export carries (:mod:`.assets`)."""
