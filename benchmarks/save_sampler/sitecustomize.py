"""``python -m benchmarks.checkpoint_save --sample-saves``: imported at the start of each training process (this
directory is put first on its ``PYTHONPATH``), it samples, every 2 ms while the main thread is inside Megatron's
``save_checkpoint_and_time``, what the main thread and the save's threads (:data:`SAVE_THREADS`) run: the innermost of
the functions in :data:`PHASES` on each stack, else its innermost frame. At exit it writes, per save, each thread's
runs of one phase with their start and length to ``$ZAYA_SAVE_SAMPLES.<pid>.txt``."""

import atexit
import os
import sys
import threading
import time

PHASES = {
    "save_checkpoint_and_time", "generate_state_dict", "save_preprocess", "validate_sharding_integrity",
    "apply_saving_parallelization", "mcore_to_pyt_state_dict", "save_state_dict_async_plan", "prepare_write_data",
    "background_request", "schedule_async_save", "maybe_finalize_async_calls", "pool_for_save", "save_csv",
    "all_gather_object", "barrier", "synchronize", "empty_cache", "report_memory", "start", "stop", "_copy",
    "_wait_landed", "copy_to_host", "write_preloaded_data_multithread", "wait",
}
PERIOD = 0.002
# Samples further apart than this belong to different save calls. Within one call the sampler can miss tens of ms
# while the main thread holds the GIL in a long C call; save calls are whole training steps apart.
SAVE_GAP = 0.3
SAVE_THREADS = ("zaya-background-save", "zaya-local-save")  # name prefixes (checkpoint/staging.py, local_tier.py)


def _phase(frame) -> str:
    leaf = frame
    while frame is not None:
        if frame.f_code.co_name in PHASES:
            return frame.f_code.co_name
        frame = frame.f_back
    return f"{os.path.basename(leaf.f_code.co_filename)}:{leaf.f_code.co_name}:{leaf.f_lineno}"


def _inside_save(frame) -> bool:
    while frame is not None:
        if frame.f_code.co_name == "save_checkpoint_and_time":
            return True
        frame = frame.f_back
    return False


def _sample(samples: list) -> None:
    main = threading.main_thread().ident
    while True:
        time.sleep(PERIOD)
        frames = sys._current_frames()
        if main not in frames or not _inside_save(frames[main]):
            continue
        names = {t.ident: t.name for t in threading.enumerate()}
        samples.append((time.perf_counter(), {
            "main" if ident == main else names.get(ident, "?"): _phase(frame) for ident, frame in frames.items()
            if ident == main or names.get(ident, "").startswith(SAVE_THREADS)}))


def _write(prefix: str, samples: list) -> None:
    if not samples:
        return
    saves = [[samples[0]]]
    for sample in samples[1:]:
        if sample[0] - saves[-1][-1][0] < SAVE_GAP:  # the same save call
            saves[-1].append(sample)
        else:
            saves.append([sample])
    lines = []
    for number, save in enumerate(saves, 1):
        start = save[0][0]
        lines.append(f"save {number}: {1000 * (save[-1][0] - start):.0f} ms sampled")
        for thread in sorted({name for _, phases in save for name in phases}, key=lambda n: n != "main"):
            run = None
            for clock, phases in save + [(save[-1][0] + PERIOD, {})]:
                phase = phases.get(thread)
                if run and phase != run[0]:
                    lines.append(f"  {thread:<28} {1000 * (run[1] - start):8.1f} ms  +{1000 * (clock - run[1]):7.1f} ms"
                                 f"  {run[0]}")
                    run = None
                if phase and run is None:
                    run = (phase, clock)
    with open(f"{prefix}.{os.getpid()}.txt", "w") as out:
        out.write("\n".join(lines) + "\n")


if os.environ.get("ZAYA_SAVE_SAMPLES"):
    _samples: list = []
    threading.Thread(target=_sample, args=(_samples,), name="save-sampler", daemon=True).start()
    atexit.register(_write, os.environ["ZAYA_SAVE_SAMPLES"], _samples)
