"""A local Ray cluster for the tests that start Ray actors (the verl plugin's step-buffer actor and buffer growth):
started for the duration of a `with` block when none is running (2 CPUs, no dashboard, no log forwarding), shut down
after it; a cluster that was already running is left alone. Not a fixture: each test module wraps it in its own
module-scoped fixture, so that Ray starts only where it is needed.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator


@contextlib.contextmanager
def local_ray(pickle_by_value: types.ModuleType | None = None) -> Iterator[None]:
    """Ray running inside the block. pickle_by_value: a test module whose functions Ray's workers must receive by value
    (they cannot import a test module by name)."""
    import ray

    if pickle_by_value is not None:
        ray.cloudpickle.register_pickle_by_value(pickle_by_value)
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        yield
    finally:
        if started:
            ray.shutdown()
