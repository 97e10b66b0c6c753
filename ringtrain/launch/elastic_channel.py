"""The elastic driver's messages: one listening socket, one connection per worker (elastic_protocol.py's lines).

    channel = DriverChannel()                  # listens on channel.port
    for worker, message in channel.poll(0.02, workers):
        ...                                    # message None: the worker's connection closed
    channel.send(worker, "world", rank=0, size=2, generation=1)     # False when the worker cannot be reached
    channel.drop(worker)

A new connection's first line is the worker's hello, naming it; a connection naming no live worker is closed.
Standard library only: the driver runs in the launcher, which must not start MPI.
"""
import selectors
import socket

from ..world.elastic_protocol import LineReader, encode


class DriverChannel:
    def __init__(self):
        self.selector = selectors.DefaultSelector()
        self.server = socket.create_server(("", 0))
        self.server.setblocking(False)
        self.selector.register(self.server, selectors.EVENT_READ, None)
        self.port = self.server.getsockname()[1]

    def poll(self, timeout, workers):
        """[(worker, message or None)] of what arrived within `timeout` seconds, in order."""
        events = []
        for key, _ in self.selector.select(timeout):
            if key.data is None:
                events.extend(self._accept(workers))
                continue
            worker = key.data
            try:
                data = worker.conn.recv(65536)
            except OSError:
                data = b""
            if not data:
                events.append((worker, None))
                continue
            events.extend((worker, message) for message in worker.reader.feed(data))
        return events

    def _accept(self, workers):
        try:
            conn, _ = self.server.accept()
        except BlockingIOError:
            return []
        conn.setblocking(True)
        conn.settimeout(10)
        line = b""
        try:
            while not line.endswith(b"\n"):
                chunk = conn.recv(4096)
                if not chunk:
                    conn.close()
                    return []
                line += chunk
        except OSError:
            conn.close()
            return []
        reader = LineReader()
        hello, *more = reader.feed(line)          # what the worker sent right after its hello may be here too
        worker = next((w for w in workers if w.id == hello.get("worker") and not w.gone), None)
        if worker is None:
            conn.close()
            return []
        conn.settimeout(None)
        worker.conn, worker.reader = conn, reader
        self.selector.register(conn, selectors.EVENT_READ, worker)
        return [(worker, message) for message in more]

    def send(self, worker, op, **fields):
        try:
            worker.conn.sendall(encode(op, **fields))
            return True
        except (OSError, AttributeError):
            return False

    def drop(self, worker):
        if worker.conn is not None:
            try:
                self.selector.unregister(worker.conn)
            except (KeyError, ValueError):
                pass
            worker.conn.close()
            worker.conn = None

    def close(self):
        self.server.close()
