"""What a run measures, over plain torch objects: the five categories and the phases of a step (`footprint`),
every live tensor attributed by torch's MemTracker and the process's own peak (`tracker`), NVML's figure for
this process (`nvml`), the ``memory.json`` and ``bench.json`` files, read and written only here (`records`),
the table that shows footprints side by side (`report`) and the picture of a step, predicted against measured
(`picture`, drawn with matplotlib where it is installed). Imports nothing of the training runtime."""
