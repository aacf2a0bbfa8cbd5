"""Verification: the exact acceptance / residual / bonus protocol for chains
(:mod:`~specdec.verify.chain`) and candidate trees (:mod:`~specdec.verify.tree`), reproducible
sampling at a request's own uniforms (:mod:`~specdec.verify.reproducible`), the processed
distributions everything samples from (:mod:`~specdec.verify.sampling`), and the statistics the
exactness checks use (:mod:`~specdec.verify.stats`). Tensors in, tensors out: no model, no engine."""
