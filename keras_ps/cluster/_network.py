"""Addresses, whether a task's gRPC server answers, and which process it is.
No TensorFlow needed at import."""

import socket
import time

from keras_ps import _tf_adapter

# An HTTP/2 client connection preface and an empty SETTINGS frame.
_HTTP2_PREFACE = (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
                  b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")
_SETTINGS_FRAME = 4


def split_address(address):
    """`"host:port"` -> (host, port); an IPv6 host loses its brackets.

    Raises:
        ValueError: no `:port`, or a port that is not a number.
    """
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"Expected 'host:port'. Received: {address!r}.")
    return host.strip("[]"), int(port)


def probe(address, timeout):
    """True if a gRPC server answers at `address` within `timeout` seconds.

    Opens an HTTP/2 connection and waits for the server's SETTINGS frame, the
    first thing a live gRPC server sends: milliseconds on a live server, an
    immediate False when nothing listens, and False after `timeout` for a
    stopped (SIGSTOP) process, whose kernel still accepts the TCP connection.
    (gRPC's own channel-ready check polls, about 0.2 s per call.)
    """
    header, _ = _first_frame_header(address, timeout)
    return header is not None and header[3] == _SETTINGS_FRAME


def _first_frame_header(address, timeout):
    """(The first 9 bytes the server at `address` sends to an HTTP/2 client
    (a frame header, from an HTTP/2 server), None); or (None, why fewer
    came within `timeout` seconds, said as a clause): nothing listens, the
    connection is not accepted, or a process accepts it and sends nothing
    (a stopped or hung process)."""
    deadline = time.monotonic() + timeout
    try:
        host, port = split_address(address)
        sock = socket.create_connection((host, port), timeout=timeout)
    except ConnectionRefusedError:
        return None, "nothing listens on that port (the connection is refused)"
    except TimeoutError:
        return None, (f"a connection there is not accepted within {timeout:g}s"
                      " (a host that drops packets, the wrong host, or a "
                      "stopped process whose queue of connections is full)")
    except (OSError, ValueError) as e:
        return None, f"it cannot be reached ({e})"
    header = b""
    with sock:
        try:
            sock.sendall(_HTTP2_PREFACE)
            while len(header) < 9:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError
                sock.settimeout(remaining)
                chunk = sock.recv(9 - len(header))
                if not chunk:
                    return None, ("a process there closes each connection "
                                  + (f"after {header!r}" if header else
                                     "without a word"))
                header += chunk
        except TimeoutError:
            sent = f"{header!r} and no more" if header else "nothing"
            return None, (f"a process there accepts connections but sends "
                          f"{sent} within {timeout:g}s (a stopped or hung "
                          "process, or a server of another kind)")
        except OSError as e:
            return None, f"the connection there fails ({e})"
    return header, None


def look_at_new_worker(address, timeout):
    """A new member's address, looked at while it waits to be admitted:
    (whether a gRPC server answers there, why what answers cannot serve as
    a worker task or None). Refused: a server of another protocol (an HTTP
    or SSH port), or of another gRPC service, or a TF ps or chief task."""
    header, _ = _first_frame_header(address, timeout)
    if header is None:
        return False, None  # not yet: a task still starting
    if header[3] != _SETTINGS_FRAME:
        return True, ("it is not a gRPC server: it answered an HTTP/2 client "
                      f"with {header!r}, the bytes of another protocol")
    return True, worker_refusal(address, timeout)


def why_silent(address, timeout):
    """Why no gRPC server answers at `address`, said as a clause (see
    _first_frame_header)."""
    return (_first_frame_header(address, timeout)[1]
            or "something began to answer there just now")


def _get_status(address, timeout, deserializer):
    """TF's WorkerService/GetStatus call (an empty request) to `address`:
    its response through `deserializer`. Raises grpc.RpcError."""
    import grpc

    with grpc.insecure_channel(address) as channel:
        return channel.unary_unary(
            "/tensorflow.WorkerService/GetStatus",
            request_serializer=lambda _: b"",  # an empty GetStatusRequest
            response_deserializer=deserializer)(None, timeout=timeout)


def incarnation(address, timeout):
    """The incarnation of the TF server at `address` (its first device's: a
    random number drawn when the process started, so a task restarted on
    the same address has another), or None when it does not answer within
    `timeout` seconds (a stopped process) or cannot be asked."""
    import grpc

    try:
        devices = _get_status(address, timeout, _device_attributes)
    except (grpc.RpcError, ValueError, IndexError):
        return None
    return devices[0].incarnation if devices else None


# The status codes with which a gRPC server that is no TF server (another
# service, such as keras_ps' rendezvous) answers TF's WorkerService.
_FOREIGN_CODES = ("UNIMPLEMENTED", "UNAUTHENTICATED", "PERMISSION_DENIED")
# The jobs whose tasks have their own place in the training cluster: a ps
# listed again as a worker hung TF's cluster update; the chief is the
# coordinator itself.
_NOT_WORKER_JOBS = ("ps", "chief")


def _refusal(error):
    """"CODE: details" of a grpc.RpcError from a server of another service;
    None for any other failure (unreachable, deadline, TF's own errors)."""
    if error.code().name in _FOREIGN_CODES:
        return f"{error.code().name}: {error.details() or ''}"
    return None


def foreign_service(address, timeout):
    """How the gRPC server at `address` refused TF's WorkerService/GetStatus
    call, when it serves another service: "CODE: details". None when a TF
    server answers (or nothing does within `timeout` seconds)."""
    import grpc

    try:
        _get_status(address, timeout, bytes)
    except grpc.RpcError as error:
        return _refusal(error)
    return None


def worker_refusal(address, timeout):
    """Why the gRPC server at `address` cannot serve as a worker task, said
    as "it is ...": it serves another service (its refusal of TF's
    WorkerService), or it is a TF task started as a ps or the chief (its
    device names the job). None when it can, or when it does not answer
    TF's GetStatus call within `timeout` seconds."""
    import grpc

    try:
        devices = _get_status(address, timeout, _device_attributes)
    except grpc.RpcError as error:
        refusal = _refusal(error)
        return refusal and ("it is not a TensorFlow server: it answered TF's "
                            f"WorkerService with {refusal!r}")
    # A device name: /job:ps/replica:0/task:0/device:CPU:0.
    parts = devices[0].name.split("/") if devices else []
    job = parts[1][len("job:"):] if len(parts) > 4 else None
    if job in _NOT_WORKER_JOBS:
        return (f"it is the TensorFlow task {'/'.join(parts[:4])}, started "
                f"as a {job} task, not a worker")
    return None


def _device_attributes(get_status_response):
    """The DeviceAttributes of each device in a GetStatusResponse's bytes
    (repeated DeviceAttributes, field 1)."""
    devices, i, data = [], 0, get_status_response
    while i < len(data):
        if data[i] != 0x0A:  # field 1, length-delimited
            raise ValueError(f"unexpected GetStatus field tag {data[i]}")
        i, size, shift = i + 1, 0, 0
        while True:  # a varint
            byte = data[i]
            i, size, shift = i + 1, size | (byte & 0x7F) << shift, shift + 7
            if not byte & 0x80:
                break
        devices.append(_tf_adapter.device_attributes(data[i:i + size]))
        i += size
    return devices


def wait_until_answers(address, timeout, process=None):
    """Waits until a gRPC server answers at `address`; False on timeout, or
    at once when `process` (the server's process, if given) has exited."""
    deadline = time.monotonic() + timeout
    while True:
        if process is not None and process.poll() is not None:
            return False
        if probe(address, min(1.0, max(0.05, deadline - time.monotonic()))):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


# The exit code of `python -m keras_ps.server` when its address cannot be
# bound (another process holds the port). A launcher that picked the port
# itself can pick another and start the task again.
EXIT_ADDRESS_TAKEN = 3
# What `python -m keras_ps.server` puts before its one-line errors, which a
# launcher can quote from the task's output.
SERVER_ERROR_PREFIX = "keras_ps.server: error: "


def address_taken(job, index, address,
                  spec="its cluster spec (TF_CONFIG, or --cluster_spec)"):
    """The message for a task whose port another process holds."""
    port = split_address(address)[1]
    return (f"port of {job}:{index} ({address}) is already in use: another "
            f"process on this machine holds port {port}, so {job}:{index} "
            "cannot serve there. Stop the process holding it (`ss -ltnp` "
            f"lists them), or give {job}:{index} a free port in {spec}.")


def port_is_free(port):
    """True when this machine can bind `port` (no server listens on it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", int(port)))
        except OSError:
            return False
    return True
