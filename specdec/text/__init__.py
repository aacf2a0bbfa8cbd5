"""Text around the ids-only engine: a request's session (stop strings, streaming:
:mod:`~specdec.text.session`), incremental detokenization (:mod:`~specdec.text.detokenize`) and
chat encoding (:mod:`~specdec.text.chat`)."""
