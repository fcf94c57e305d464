"""A local Ray cluster for the tests that start Ray actors (the verl plugin's step-buffer actor and buffer growth):
started for the duration of a `with` block when none is running (2 CPUs, no dashboard, no log forwarding), shut down
after it; a cluster that was already running is left alone. `SLOW_MACHINE`: Ray's own startup limits lengthened, for
this and for the tests that start a ray.cluster_utils.Cluster. Not a fixture: each test module wraps it in its own
module-scoped fixture, so that Ray starts only where it is needed.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator

# Ray's limits on how long a process it starts may take to register (defaults: 60 s for a worker, 10 s for a raylet's
# agents): a starved process on a loaded 2-core machine registers late, not wrongly. Ray's driver-side 30 s wait for
# a raylet to register (ray/_private/node.py) has no setting.
SLOW_MACHINE = {"worker_register_timeout_seconds": 300, "agent_register_timeout_ms": 300_000}


@contextlib.contextmanager
def local_ray(pickle_by_value: types.ModuleType | None = None) -> Iterator[None]:
    """Ray running inside the block. pickle_by_value: a test module whose functions Ray's workers must receive by value
    (they cannot import a test module by name)."""
    import ray

    if pickle_by_value is not None:
        ray.cloudpickle.register_pickle_by_value(pickle_by_value)
    started = not ray.is_initialized()
    if started:
        quiet = {"include_dashboard": False, "log_to_driver": False, "configure_logging": False}
        ray.init(num_cpus=2, _system_config=SLOW_MACHINE, **quiet)
    try:
        yield
    finally:
        if started:
            ray.shutdown()
