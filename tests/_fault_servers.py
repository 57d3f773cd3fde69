"""Fake engine and fake SearXNG for the load test, in their own process (python tests/_fault_servers.py PLAN PORTS).

The engine speaks /generate over a hand-written HTTP/1.1 loop so that it can send any bytes: it replays
the plan's turn ids for rollout `sampling_seed // 1000`, turn `sampling_seed % 1000`, and injects the
plan's fault at its turn: http_500, bad_json, truncated (Content-Length past the bytes sent, then close),
nan_logprob, wrong_types, drop (close without an answer) or hang (answer nothing until the client hangs
up). First turns wait at a barrier until `barrier` of them are in, so the peak in flight is exact.
The search server answers `fast ...` at once, `slow ...` after `slow_s`, `fail ...` with HTTP 500.
GET /stats on each reports what it saw; the ports go to PORTS as JSON once both listen.
"""
import asyncio
import json
import math
import os
import sys

from aiohttp import web


def logprob(token: int, step: int) -> float:
    return -(1 + token % 7) / 8 - step / 1000


class FakeEngine:
    def __init__(self, plan: dict):
        self.turns = {int(i): t for i, t in plan["turns"].items()}
        self.faults = {int(i): tuple(f) for i, f in plan["faults"].items()}
        self.barrier, self.barrier_timeout_s = plan["barrier"], plan["barrier_timeout_s"]
        self.first_turns = 0
        self.released = asyncio.Event()
        self.stats = {"requests": 0, "inflight": 0, "peak_inflight": 0, "open_connections": 0, "injected": {}}

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.stats["open_connections"] += 1
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                lines = head.decode("latin-1").split("\r\n")
                method, path = lines[0].split(" ")[:2]
                headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:] if ":" in ln)}
                body = await reader.readexactly(int(headers.get("content-length", 0)))
                if method == "GET" and path == "/stats":
                    others = dict(self.stats, open_connections=self.stats["open_connections"] - 1)  # not this one
                    await self.send(writer, 200, json.dumps(others).encode())
                    continue
                if not await self.generate(json.loads(body), reader, writer):
                    return
        except ConnectionError:
            return
        finally:
            self.stats["open_connections"] -= 1
            writer.close()

    async def send(self, writer, status: int, body: bytes, length: int = None) -> None:
        reason = {200: "OK", 500: "Internal Server Error"}[status]
        writer.write(f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body) if length is None else length}\r\n\r\n".encode() + body)
        await writer.drain()

    async def generate(self, req: dict, reader, writer) -> bool:
        """Answer one /generate; False when the connection must close."""
        seed = req["sampling_params"]["sampling_seed"]
        rollout, turn = divmod(seed, 1000)
        self.stats["requests"] += 1
        self.stats["inflight"] += 1
        self.stats["peak_inflight"] = max(self.stats["peak_inflight"], self.stats["inflight"])
        try:
            if turn == 0:
                self.first_turns += 1
                if self.first_turns >= self.barrier:
                    self.released.set()
                try:  # bounded: a client that never reaches the barrier fails the peak check, it does not hang
                    await asyncio.wait_for(self.released.wait(), self.barrier_timeout_s)
                except asyncio.TimeoutError:
                    self.released.set()
            fault = self.faults.get(rollout)
            kind = fault[1] if fault is not None and fault[0] == turn else None
            if kind is not None:
                self.stats["injected"][kind] = self.stats["injected"].get(kind, 0) + 1
            return await self.answer(kind, self.turns[rollout][turn], req, reader, writer)
        finally:
            self.stats["inflight"] -= 1

    async def answer(self, kind, ids, req, reader, writer) -> bool:
        stops = set(req["sampling_params"]["stop_token_ids"])
        out = ids[: req["sampling_params"]["max_new_tokens"]]
        rows = [[logprob(t, k), t, None] for k, t in enumerate(out)]
        finish = {"type": "stop", "matched": out[-1]} if out[-1] in stops else {"type": "length"}
        body = {"output_ids": out, "meta_info": {"finish_reason": finish, "output_token_logprobs": rows,
                                                 "weight_version": "fake-0", "prompt_tokens": len(req["input_ids"])}}
        if kind == "drop":
            return False
        if kind == "hang":
            await reader.read()  # until the client gives up and closes
            return False
        if kind == "http_500":
            await self.send(writer, 500, b'{"error": "scheduler crashed"}')
            return True
        if kind == "nan_logprob":
            rows[len(rows) // 2][0] = math.nan
        if kind == "wrong_types":
            body["output_ids"] = " ".join(map(str, out))
        data = json.dumps(body).encode()  # NaN goes out as the bare literal NaN, as Python's json writes it
        if kind == "bad_json":
            data = data[: len(data) // 2]
        if kind == "truncated":
            await self.send(writer, 200, data[:100], length=len(data))
            return False
        await self.send(writer, 200, data)
        return True


def search_app(slow_s: float) -> web.Application:
    stats = {"fast": 0, "slow": 0, "fail": 0, "inflight": 0, "peak_inflight": 0}

    async def search(request: web.Request) -> web.Response:
        query = request.query["q"]
        kind = query.split()[0]
        stats[kind] += 1
        stats["inflight"] += 1
        stats["peak_inflight"] = max(stats["peak_inflight"], stats["inflight"])
        try:
            if kind == "fail":
                return web.json_response({"error": "backend down"}, status=500)
            if kind == "slow":
                await asyncio.sleep(slow_s)
            return web.json_response({"results": [{"url": f"https://example.org/{query.replace(' ', '_')}",
                                                   "title": query, "content": f"about {query}"}]})
        finally:
            stats["inflight"] -= 1

    async def get_stats(request: web.Request) -> web.Response:
        return web.json_response(stats)

    app = web.Application()
    app.router.add_get("/search", search)
    app.router.add_get("/stats", get_stats)
    return app


async def main(plan_path: str, ports_path: str) -> None:
    with open(plan_path) as f:
        plan = json.load(f)
    engine = FakeEngine(plan)
    server = await asyncio.start_server(engine.serve, "127.0.0.1", 0, backlog=1024)
    runner = web.AppRunner(search_app(plan["slow_s"]), access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, backlog=1024)
    await site.start()
    ports = {"engine": server.sockets[0].getsockname()[1], "search": site._server.sockets[0].getsockname()[1]}
    with open(ports_path + ".tmp", "w") as f:
        json.dump(ports, f)
    os.replace(ports_path + ".tmp", ports_path)
    await asyncio.Event().wait()  # until the test terminates the process


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
