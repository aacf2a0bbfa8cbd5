"""The decoding core: the engine and its step (:mod:`~specdec.core.engine`), the rows in flight
(:mod:`~specdec.core.rows`), prefill grouping (:mod:`~specdec.core.prefill`), verification blocks
(:mod:`~specdec.core.blocks`), adaptive k (:mod:`~specdec.core.adaptive`), the prefix cache
(:mod:`~specdec.core.prefix_cache`), the feature recorder a caller attaches
(:mod:`~specdec.core.recorder`), the metrics, and the one-row reference step that documents
the engine and checks it (:mod:`~specdec.core.reference`). Token ids in and out: text is
:mod:`specdec.text`'s, verification :mod:`specdec.verify`'s."""
