"""Is ``--rdzv-endpoint`` a place the machines can meet? Checked before torchrun starts.

torchrun's rendezvous hosts its store at the endpoint on the machine that owns it, or joins the
store found there. A port held by another program makes it wait without a word until its
join timeout (10 minutes): a program listening there takes the connection and never answers a
store's request; one holding the port without listening makes the bind fail and the join be
refused, again and again. Both are one error here, within seconds.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import os
import socket
import sys
import threading
from collections.abc import Iterator

from coretrain import UserError

PROBE_SECONDS = 10.0
"""How long a store has to answer: a real one answers in milliseconds."""


def check_endpoint(endpoint: str, conf: str | None = None) -> None:
    """One error if ``endpoint`` (HOST:PORT) is held by something that is not a rendezvous store;
    a store has ``--rdzv-conf read_timeout`` seconds to answer (torchrun's own knob), else 10."""
    seconds = rdzv_settings(conf, {"read_timeout": PROBE_SECONDS})["read_timeout"]
    host, _, port_text = endpoint.rpartition(":")
    if not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise UserError(f"--rdzv-endpoint {endpoint}: expected HOST:PORT, e.g. node0.cluster:29500")
    port = int(port_text)
    if _connects(host, port):  # (refused or unreachable: torchrun waits for it, as it should)
        # a store that went away between the two looks (a job that ended as this machine came)
        # leaves the port free, not held: the launcher goes on as for a port nobody listens on
        if not _answers_as_a_store(host, port, seconds) and _connects(host, port) is not False:
            raise UserError(
                f"--rdzv-endpoint {endpoint}: another program listens there and does not answer as a "
                f"rendezvous store (none within {seconds:.0f} s); choose a free port"
            )
    elif _is_this_machine(host) and not _can_bind(host, port):
        raise UserError(f"--rdzv-endpoint {endpoint}: the port is held by another program; choose a free port")


def rdzv_settings(conf: str | None, defaults: dict[str, float]) -> dict[str, float]:
    """``--rdzv-conf key=value,...``: the numbers named in ``defaults``, else those defaults (other
    keys are torchrun's business)."""
    found = dict(defaults)
    for pair in filter(None, (conf or "").split(",")):
        key, _, value = pair.partition("=")
        if key.strip() in found:
            try:
                found[key.strip()] = float(value)
            except ValueError:
                raise UserError(f"--rdzv-conf {pair.strip()}: expected a number") from None
    return found


def _connects(host: str, port: int) -> bool | None:
    """True: something listens there; False: the connection is refused (nothing listens); None:
    unreachable, not resolvable yet, or a silent program's full backlog (timed out)."""
    try:
        with socket.create_connection((host, port), timeout=5):
            return True
    except ConnectionRefusedError:
        return False
    except OSError:
        return None


def _is_this_machine(host: str) -> bool:
    try:
        address = socket.gethostbyname(host)
    except OSError:
        return False
    return address.startswith("127.") or address in {socket.gethostbyname(socket.gethostname()), "0.0.0.0"}


def _can_bind(host: str, port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind((host, port))
        except OSError as exc:
            return exc.errno != errno.EADDRINUSE
    return True


def _answers_as_a_store(host: str, port: int, seconds: float) -> bool:
    """A torch TCPStore client's round trip, given ``seconds`` (a thread: the client can wait on a
    silent server past its own timeout)."""
    import torch.distributed as dist

    done, answered = threading.Event(), list[bool]()

    def probe() -> None:
        try:
            client = dist.TCPStore  # type: ignore[attr-defined]  # torch exports it untyped
            store = client(host, port, is_master=False, timeout=datetime.timedelta(seconds=seconds))
            store.check(["coretrain/endpoint-probe"])
            answered.append(True)
        except Exception:  # noqa: S110 - not answering as a store is the answer
            pass
        finally:
            done.set()  # a refused or closed connection ends the wait at once

    with _quiet_stderr():  # torch's C++ client logs each failed try itself; the verdict is ours to say
        threading.Thread(target=probe, name="coretrain-rdzv-probe", daemon=True).start()
        done.wait(seconds)
        return bool(answered)


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """File descriptor 2 to /dev/null for a while (C++ code writes there, not to sys.stderr)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
