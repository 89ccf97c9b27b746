"""Both ends of the wire protocol between the server (executor.py), the template (template.py) and
a cell's init (cell.py). Standard library only: the template imports it.

All sockets are SOCK_SEQPACKET Unix sockets, one message per send, descriptors as SCM_RIGHTS.

- template -> server, once: a JSON report of the isolation the kernel allowed (`send_json`).
- server -> template: a JSON cell spec; the answer is a JSON dict with the init's pid plus the
  server's end of a socket to it (`request_cell` / `answer_cell`), or {"error": ...}.
- cell -> server, once: a JSON readiness report (`send_json` / `receive_json`).
- server -> cell, per call: a JSON request plus the write ends of the call's stdout, stderr and
  status pipes (`send_call` / `receive_call`); b"K<call number>" on the same socket asks the cell
  to kill that call (`kill_message` / `is_kill`).
- cell -> server, per call, on the status pipe: b"S" + the program's wait status and why the call
  ended (`write_status`), or b"E" + why the call could not start (`write_error`); read with
  `parse_status`.
"""

import json
import os
import socket
import struct

MESSAGE_MAX = 1 << 16
_KILL = b"K"
_STATUS, _ERROR = b"S", b"E"
_STATUS_BODY = struct.Struct("<iB")  # wait status (-1: none), why the call ended

END_EXITED, END_TIMEOUT, END_KILLED = 0, 1, 2  # why a call ended


def send_json(sock: socket.socket, message: dict) -> None:
    sock.send(json.dumps(message).encode())


def receive_json(sock: socket.socket) -> dict:
    """The next JSON message; {} when the peer hung up."""
    return json.loads(sock.recv(MESSAGE_MAX) or b"{}")


def request_cell(sock: socket.socket, spec: dict) -> tuple[dict | None, list[int]]:
    """Ask the template for a cell: its answer (None when the template hung up) and the
    descriptors that came with it."""
    send_json(sock, spec)
    message, fds, _, _ = socket.recv_fds(sock, MESSAGE_MAX, 1)
    return (json.loads(message) if message else None), fds


def receive_cell_request(sock: socket.socket) -> dict | None:
    """The server's next cell spec; None once it has hung up."""
    message = sock.recv(MESSAGE_MAX)
    return json.loads(message) if message else None


def answer_cell(sock: socket.socket, info: dict, cell_sock: socket.socket) -> None:
    socket.send_fds(sock, [json.dumps(info).encode()], [cell_sock.fileno()])


def send_call(sock: socket.socket, request: dict, pipes: list[int]) -> None:
    socket.send_fds(sock, [json.dumps(request).encode()], pipes)


def receive_call(sock: socket.socket) -> tuple[dict, list[int]] | None:
    """The next call's request and pipes, or None once the server has hung up. A kill that
    arrives after its call ended is dropped here."""
    while True:
        message, fds, _, _ = socket.recv_fds(sock, MESSAGE_MAX, 8)
        if message and not message.startswith(_KILL) and len(fds) == 3:
            return json.loads(message), fds
        for fd in fds:
            os.close(fd)
        if not message:
            return None


def kill_message(call: int) -> bytes:
    return _KILL + b"%d" % call


def is_kill(message: bytes, call: int) -> bool:
    return message == kill_message(call)


def write_status(fd: int, wait_status: int | None, why: int) -> None:
    os.write(fd, _STATUS + _STATUS_BODY.pack(-1 if wait_status is None else wait_status, why))


def write_error(fd: int, exc: BaseException) -> None:
    os.write(fd, _ERROR + f"{type(exc).__name__}: {exc}".encode()[:200])


def parse_status(buf: bytes) -> tuple[str | None, int | None, int | None] | None:
    """(error, wait status, why) from what the status pipe held so far; None while incomplete."""
    if buf[:1] == _ERROR:
        return buf[1:].decode("utf-8", errors="replace"), None, None
    if buf[:1] == _STATUS and len(buf) > _STATUS_BODY.size:
        wait_status, why = _STATUS_BODY.unpack(buf[1 : 1 + _STATUS_BODY.size])
        return None, wait_status, why
    return None
