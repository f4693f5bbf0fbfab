"""The worker process of ``MultiprocExecutor``: one rank's ``WorkerWrapper``, serving the calls of its two
lanes (steps and RPCs in order on the main thread, ``run_aside`` on a second one) from the engine process.

Below the executor, so no asyncio here: plain pipes and threads. The wire format is the executor's (see
``aioengine.executor.multiproc``): ``(call_id, method, args, kwargs)`` in, ``(call_id, ok, value)`` out.
A ``StepMessage`` argument is a model step against the one before: the step lane's decoder turns it back
into its ``SchedulerOutput`` before the call, every one in order (also one whose step then fails).
"""

from __future__ import annotations

import os
import pickle
import signal
import threading
import traceback
from multiprocessing.connection import Connection

import cloudpickle  # type: ignore[import-untyped]

from aioengine import gc_heap
from aioengine.worker.step_wire import StepDecoder, StepMessage
from aioengine.worker.wrapper import WorkerWrapper


def dumps(obj: object) -> bytes:
    """Plain pickle, or cloudpickle for what plain pickle cannot take (lambdas, local classes)."""
    try:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, TypeError, AttributeError):
        data: bytes = cloudpickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        return data


def worker_main(rank: int, step_conn: Connection, aside_conn: Connection) -> None:
    """A worker process's life: the step lane on the main thread, the aside lane on a second one."""
    # Ctrl-C in a terminal reaches the whole process group; the engine process decides how workers end.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    wrapper = WorkerWrapper(rank)
    aside = threading.Thread(
        target=_serve, args=(aside_conn, wrapper, True), name=f"aioengine-aside-{rank}", daemon=True
    )
    aside.start()
    _serve(step_conn, wrapper, False, StepDecoder())  # steps come on the step lane only


def _serve(conn: Connection, wrapper: WorkerWrapper, is_aside: bool, steps: StepDecoder | None = None) -> None:
    """Runs the calls of one lane in order until asked to stop or the engine process is gone."""
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            if is_aside:
                # The engine process closes the lanes only once this process ended, so it is gone: end
                # now, even while the step lane is inside a long call.
                os._exit(1)
            return
        reply, stop = run_call(data, wrapper, steps)
        try:
            conn.send_bytes(reply)
        except OSError:
            return
        if stop:
            return


def run_call(data: bytes, wrapper: WorkerWrapper, steps: StepDecoder | None = None) -> tuple[bytes, bool]:
    """One call on the wire: its reply, and whether it asked the process to stop. ``steps`` (the step lane's
    decoder) turns a ``StepMessage`` argument back into its ``SchedulerOutput``."""
    call_id = None  # a message that cannot be read is answered as the oldest call of its lane
    stop = False
    try:
        call_id, method, args, kwargs = pickle.loads(data)
        if steps is not None and args and isinstance(args[0], StepMessage):
            args = (steps.decode(args[0]), *args[1:])
        if method is None:
            stop = True
            if wrapper.worker is not None:
                wrapper.worker.shutdown()
            result = None
        elif isinstance(method, str):
            result = getattr(wrapper, method)(*args, **kwargs)
            worker = wrapper.worker
            if method == "compile_or_warm_up_model" and worker is not None and worker.config.scheduler.freeze_gc:
                gc_heap.freeze_for_good()  # the rank's heap is built: its model, its kernels, its warm-up
        else:
            result = pickle.loads(method)(wrapper.worker, *args, **kwargs)
    except Exception as exc:
        return _reply(call_id, False, portable_error(exc, wrapper.rank), wrapper.rank), stop
    return _reply(call_id, True, result, wrapper.rank), stop


def _reply(call_id: int | None, ok: bool, value: object, rank: int) -> bytes:
    try:
        return dumps((call_id, ok, value))
    except Exception as exc:
        error = RuntimeError(
            f"worker rank {rank}: the result ({type(value).__qualname__}) cannot be sent to the engine process: "
            f"{exc}; return plain data (numbers, strings, lists, dicts, dataclasses)"
        )
        return pickle.dumps((call_id, False, error))


def portable_error(exc: Exception, rank: int) -> BaseException:
    """``exc`` itself, with the worker's traceback as a note, when it survives pickling; else a RuntimeError
    carrying its type, message and traceback."""
    trace = "".join(traceback.format_exception(exc))
    try:
        exc.add_note(f"raised in worker rank {rank} (pid {os.getpid()}):\n{trace}")
        pickle.loads(dumps(exc))
    except Exception:
        return RuntimeError(
            f"worker rank {rank} raised {type(exc).__qualname__}: {exc} (it cannot be sent as it is):\n{trace}"
        )
    return exc
