"""The Python programs the network-namespace tests run on a host (`Hosts.run_python`,
`Hosts.start_python`): clients, a load run, a status client and a delaying TCP proxy."""

# A client run on a host (COORDINATOR: one address, or A,B for generate): `busy COORDINATOR` the
# first worker it sees running a request (none within 60 s: nothing), `watch COORDINATOR` the same
# after a line "watching" once its first status call was answered; `generate COORDINATOR
# PROMPTS_JSON [OPTIONS_JSON]` sends each prompt greedily in turn (options as Client.generate's,
# default 8 tokens) and prints one JSON line per answer (its tokens, usage and when it ended,
# time.time()), an error as {"error": ...} (the run goes on).
CLIENT = """
import json, sys, time
from base.generation import Finished, Piece
from coordinator.client import Client
command, coordinator = sys.argv[1], sys.argv[2]
with Client(coordinator.split(","), timeout=60.0) as client:
    if command in ("busy", "watch"):  # poll every 20 ms, up to 60 s, for a worker running a request; print it
        if command == "watch":
            client.status()
            print("watching", flush=True)
        deadline = time.monotonic() + 60.0
        while time.monotonic() < deadline:
            busy = [m.address for m in client.status().members if m.role == "worker" and m.outstanding]
            if busy:
                print(busy[0])
                break
            time.sleep(0.02)
    else:
        options = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {"max_tokens": 8}
        for prompt in json.loads(sys.argv[3]):
            tokens, usage = [], None
            try:
                for event in client.generate(prompt, temperature=0.0, **options):
                    if isinstance(event, Piece):
                        tokens.extend(event.token_ids)
                    elif isinstance(event, Finished):
                        usage = event.usage.to_dict()
                print(json.dumps({"tokens": tokens, "usage": usage, "ended": time.time()}), flush=True)
            except Exception as exc:
                print(json.dumps({"error": str(exc)}), flush=True)
"""


# A load run on a host: `LOAD COORDINATORS REQUESTS_JSON THREADS PAUSE_S MAX_REQUESTS MAX_SECONDS`.
# REQUESTS_JSON is a list of Client.generate keyword arguments (each with its "prompt"). THREADS
# threads, each with a Client of its own over every coordinator (A,B: the first one first), send
# the requests in turn, over and over, pausing PAUSE_S after each answer, until stdin closes,
# MAX_REQUESTS were sent or MAX_SECONDS passed. One JSON line per answer: its index in REQUESTS,
# tokens, usage and when it started and ended (time.time()), or its index and {"error": ...}.
LOAD = """
import itertools, json, sys, threading, time
from base.generation import Finished, Piece
from coordinator.client import Client
coordinators, requests = sys.argv[1].split(","), json.loads(sys.argv[2])
threads, pause_s, max_requests, max_seconds = int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6])
stop, lock, counter = threading.Event(), threading.Lock(), itertools.count()
deadline = time.monotonic() + max_seconds

def watch_stdin():
    sys.stdin.read()  # returns when the test closes our stdin
    stop.set()

def run():
    with Client(coordinators, timeout=60.0) as client:
        while not stop.is_set() and time.monotonic() < deadline:
            number = next(counter)
            if number >= max_requests:
                return
            index = number % len(requests)
            options = dict(requests[index])
            tokens, usage, started = [], None, time.time()
            try:
                for event in client.generate(options.pop("prompt"), **options):
                    if isinstance(event, Piece):
                        tokens.extend(event.token_ids)
                    elif isinstance(event, Finished):
                        usage = event.usage.to_dict()
                line = {"index": index, "tokens": tokens, "usage": usage, "started": started, "ended": time.time()}
            except Exception as exc:
                line = {"index": index, "error": str(exc), "started": started, "ended": time.time()}
            with lock:
                print(json.dumps(line), flush=True)
            stop.wait(pause_s)

threading.Thread(target=watch_stdin, daemon=True).start()
running = [threading.Thread(target=run) for _ in range(threads)]
for thread in running:
    thread.start()
for thread in running:
    thread.join()
"""


# A status client left running on a host (Hosts.status): a coordinator's address a line on stdin,
# one JSON line back: {"epoch": ..., "members": {address: alive}}, or {"error": ...} when it does
# not answer within 5 s. A channel of its own each time, as a client started anew would have.
STATUS = """
import json, sys
from coordinator.client import Client
for line in sys.stdin:
    try:
        with Client([line.strip()], timeout=10.0) as client:
            status = client.status(timeout=5.0)
        print(json.dumps({"epoch": str(status.epoch), "members": {m.address: m.alive for m in status.members}}),
              flush=True)
    except Exception as exc:
        print(json.dumps({"error": str(exc)}), flush=True)
"""


# A TCP proxy that adds latency, run on a host: `PROXY DELAY_MS LISTEN_HOST PORT:TARGET_HOST:PORT...`.
# The kernel here has no netem qdisc, so delay is made in userspace: each chunk read is held until
# DELAY_MS after it arrived, then written on, in each direction, so the latency is added without
# capping the rate (chunks read meanwhile queue behind it). Prints "ready" once it listens.
PROXY = """
import collections, socket, sys, threading, time
delay_s, host = float(sys.argv[1]) / 1000, sys.argv[2]

def pump(src, dst):
    held, lock, more = collections.deque(), threading.Condition(), [True]
    def read():
        while True:
            try:
                chunk = src.recv(1 << 20)
            except OSError:
                chunk = b""
            with lock:
                held.append((time.monotonic() + delay_s, chunk))
                lock.notify()
            if not chunk:
                return
    threading.Thread(target=read, daemon=True).start()
    while True:
        with lock:
            while not held:
                lock.wait()
            due, chunk = held.popleft()
        time.sleep(max(0.0, due - time.monotonic()))
        if not chunk:
            try:
                dst.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            return
        try:
            dst.sendall(chunk)
        except OSError:
            return

def serve(listener, target):
    while True:
        client, _ = listener.accept()
        upstream = socket.create_connection(target)
        for sock in (client, upstream):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=pump, args=(client, upstream), daemon=True).start()
        threading.Thread(target=pump, args=(upstream, client), daemon=True).start()

for route in sys.argv[3:]:
    port, target_host, target_port = route.split(":")
    listener = socket.create_server((host, int(port)))
    threading.Thread(target=serve, args=(listener, (target_host, int(target_port))), daemon=True).start()
print("ready", flush=True)
threading.Event().wait()
"""
