"""mpt: reproduce Mixed Precision Training (Micikevicius et al., ICLR 2018) and what came after it."""

import os

# torch's CPU allocator backs its large tensors with transparent huge pages when this is set before
# its first allocation. A CPU training step allocates fresh multi-megabyte tensors (gradients, casts,
# optimizer temporaries) that the OS otherwise faults in 4 KiB at a time, which can cost more than
# the arithmetic done on them. Set THP_MEM_ALLOC_ENABLE=0 to keep torch's default.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
