"""Plain-PyTorch references of every rapo_fast op: the spec the kernels are tested against.

One file per op, so that each op's spec sits next to nothing else; everything public is re-exported here.
What this is not: a fast path. The CPU fallback of the loss uses these functions chunked, nothing more.
"""

from rapo_fast.reference.encoders import *  # noqa: F401,F403
from rapo_fast.reference.kv_splice import *  # noqa: F401,F403
from rapo_fast.reference.logprobs import *  # noqa: F401,F403
from rapo_fast.reference.policy_loss import *  # noqa: F401,F403
from rapo_fast.reference.retrieval import *  # noqa: F401,F403
