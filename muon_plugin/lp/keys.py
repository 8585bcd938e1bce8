"""The state keys of MuonLP momentum: the names its checkpoints store, shared by every format.

Each format (:mod:`muon_plugin.lp.codec`) stores a parameter's momentum under some of these
keys; renaming one would make earlier checkpoints unreadable.
"""

from __future__ import annotations

BUFFER_KEY = "momentum_buffer"
"""bf16 momentum shaped like the parameter (and the fp32 buffer of ``Muon`` / ``MuonForeach``)."""
CODES_KEY = "momentum_codes"
"""int8 / fp8 codes shaped like the parameter; int4 codes two a byte."""
SCALES_KEY = "momentum_scales"
"""int8 / fp8: the fp32 scale of each block."""
SCALE_CODES_KEY = "momentum_scale_codes"
"""int4: the 8-bit log-scale code of each block."""
BASES_KEY = "momentum_scale_bases"
"""int4: the bf16 base of each super-block."""
U_KEY = "momentum_rank1_u"
"""fp8: bf16 rank-1 factor along the rows, ``(*lead, rows)``."""
W_KEY = "momentum_rank1_w"
"""fp8: bf16 rank-1 factor along the columns, ``(*lead, cols)``."""
FACTOR_KEYS = (U_KEY, W_KEY)
