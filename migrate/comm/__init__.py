"""Collective communication checks: backend adapter, correctness matrix, fallbacks, bandwidth.

Modules:
* ``backends``: which torch.distributed backend a device type uses, multi-backend
  strings, backend environment, and the source-to-target option mapping table.
* ``matrix``: per-rank collective x dtype x size checks against values computed
  without the backend, and the pure merge into a matrix.
* ``fallbacks``: compositions that replace an op or dtype the target lacks.
* ``bandwidth``: nccl-tests style algbw/busbw measurement.
* ``compare``: a source cluster's result file against the target's.
* ``report``: the result file (JSON) and its CSV, Markdown and PNG renderings.
* ``suite``: one run of all of the above on a started worker group (stage and CLI).
"""
