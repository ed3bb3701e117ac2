"""Operator numerics: forward/backward of transformer operators on a target device and
dtype against a float64 CPU reference (:mod:`.numerics`), a coverage scan of the aten
operators a model uses (:mod:`.coverage`) and a per-layer drift comparison of one
training step on two devices or dtypes (:mod:`.drift`)."""
