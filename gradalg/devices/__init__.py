"""The machine model: what a device does per second, measured once or taken from a table.

The planner (:mod:`gradalg.plan`) prices the counts of a plan (a
:class:`~gradalg.plan.cost.Cost`) with a :class:`DeviceProfile`; this package holds the
profile and where it comes from, and imports nothing from ``plan/`` or ``exec/``:

* :mod:`~gradalg.devices.record`: the profile record, what each number prices, and the pricing
  (``time_of``);
* :mod:`~gradalg.devices.measure`: the micro-benchmarks that measure it (this machine's CPU,
  any torch device);
* :mod:`~gradalg.devices.nominal`: profiles not measured (:data:`PRESETS`, GPUs from their
  spec sheets; :data:`UNMEASURED_CPU`);
* :mod:`~gradalg.devices.accelerators`: the CUDA device a model is on (cached, measured, or
  nominal by its name);
* :mod:`~gradalg.devices.cache`: the disk cache; :mod:`~gradalg.devices.lookup`:
  :func:`profile`, the one entry point.

:func:`local_profile` measures this machine's CPU the first time (about three seconds) and
caches the numbers in ``~/.cache/gradalg/devices.json`` (override the folder with
``GRADALG_CACHE``), keyed by host, architecture, torch version, thread count and
:data:`PROFILE_VERSION` (an entry of another cost model is measured again, and left alone
for the gradalg that wrote it). A model on a CUDA device is priced with that device's
profile (``profile("cuda:0")``): measured there once and cached in the same file, or the
nominal preset of its name. GPU profiles for planning runs you have not started yet come
from :data:`PRESETS`: numbers from NVIDIA's spec sheets (not measured by gradalg) times
stated sustained fractions. ``profile("h200", count=4)`` asks for four of them:
``explain()`` then gives (or refuses, with the arithmetic) the time and memory per GPU of
a data-parallel run with sharded weights (:mod:`gradalg.plan.scale`). Displays never
measure: :func:`cached_local_profile` (or ``profile(measure=False)``) returns the cached
numbers or :data:`UNMEASURED_CPU`.
"""
from .accelerators import cuda_profile, nominal_profile
from .cache import cached_local_profile, read_cached, write_cached
from .lookup import local_profile, positive_integer, profile
from .measure import host_memory, measure_cpu, measure_profile, physical_memory
from .nominal import PRESETS, UNMEASURED_CPU, nominal_key
from .record import CALIBRATION, PROFILE_VERSION, DeviceProfile

__all__ = ["DeviceProfile", "CALIBRATION", "PRESETS", "PROFILE_VERSION", "UNMEASURED_CPU", "cached_local_profile",
           "local_profile", "profile", "cuda_profile", "nominal_profile", "measure_cpu", "measure_profile",
           "read_cached", "write_cached"]
