"""A stand-in for vLLM's Responses API routes, which the simulator does not serve: what
tests/test_gateway_engine_routes.py needs of an engine to check the gateway's handling of
stored responses (they live on the replica that made them), Responses usage, `/ping` and
runtime LoRA adapters; and Anthropic's Messages API (`/v1/messages`, its `count_tokens`),
which vLLM 0.32 serves too, answering with the replica's name. Answers follow vLLM 0.32's shapes
(vllm/entrypoints/openai/responses/serving.py: the 404 of an unknown id, `usage` with
`input_tokens` / `output_tokens`, the `response.created` / `response.completed` events).

Run: `python tests/responses_engine.py PORT NAME` (NAME tells the replicas apart)."""

from __future__ import annotations

import itertools
import sys

import orjson
from aiohttp import web

MODEL = "resp-model"
_ids = itertools.count(1)


def main() -> None:
    port, name = int(sys.argv[1]), sys.argv[2]
    stored: dict[str, dict[str, object]] = {}
    adapters: list[str] = []

    def not_found(rid: str) -> web.Response:
        err = {
            "message": f"Response with id '{rid}' not found.",
            "type": "invalid_request_error",
            "param": "response_id",
            "code": 404,
        }
        return web.json_response({"error": err}, status=404)

    async def health(_: web.Request) -> web.Response:
        return web.Response()

    async def models(_: web.Request) -> web.Response:
        data = [{"id": MODEL, "object": "model", "root": MODEL, "parent": None}]
        data += [{"id": a, "object": "model", "root": "/x", "parent": MODEL} for a in adapters]
        return web.json_response({"object": "list", "data": data})

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(
            text=f'vllm:num_requests_running{{model_name="{MODEL}"}} 0.0\n'
            f'vllm:num_requests_waiting{{model_name="{MODEL}"}} 0.0\n'
        )

    async def completions(_: web.Request) -> web.Response:  # the gateway's warm-up
        return web.json_response(
            {
                "id": "cmpl-1",
                "object": "text_completion",
                "model": MODEL,
                "choices": [{"index": 0, "text": " ok", "finish_reason": "length"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }
        )

    async def responses(request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        prev = body.get("previous_response_id")
        if prev is not None and prev not in stored:
            return not_found(prev)
        turns = 1 + (int(stored[prev]["turns"]) if prev else 0)  # type: ignore[call-overload]
        rid = f"resp_{name}_{next(_ids)}"
        out = 10 * turns
        resp = {
            "id": rid,
            "object": "response",
            "model": MODEL,
            "status": "completed",
            "output": [{"type": "message", "content": [{"type": "output_text", "text": name}]}],
            "usage": {"input_tokens": 7, "output_tokens": out, "total_tokens": 7 + out},
            "previous_response_id": prev,
        }
        stored[rid] = {**resp, "turns": turns}
        if not body.get("stream"):
            return web.json_response(resp)
        s = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await s.prepare(request)
        created = {**resp, "status": "in_progress", "usage": None, "output": []}
        for i, (kind, r) in enumerate(
            (("response.created", created), ("response.completed", resp))
        ):
            event = orjson.dumps({"type": kind, "sequence_number": i, "response": r})
            await s.write(b"event: " + kind.encode() + b"\ndata: " + event + b"\n\n")
        await s.write_eof()
        return s

    async def get_response(request: web.Request) -> web.Response:
        rid = request.match_info["rid"]
        if rid not in stored:
            return not_found(rid)
        return web.json_response({k: v for k, v in stored[rid].items() if k != "turns"})

    async def cancel(request: web.Request) -> web.Response:
        rid = request.match_info["rid"]
        if rid not in stored:
            return not_found(rid)
        err = {"message": "Cannot cancel a synchronous response.", "type": "invalid_request_error"}
        return web.json_response({"error": {**err, "param": None, "code": 400}}, status=400)

    async def load(request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        if body["lora_name"] in adapters:
            err = {
                "message": f"The lora adapter '{body['lora_name']}' has already been loaded.",
                "type": "BadRequestError",
                "param": None,
                "code": 400,
            }
            return web.json_response({"error": err}, status=400)
        adapters.append(body["lora_name"])
        return web.Response(text=f"Success: LoRA adapter '{body['lora_name']}' added successfully.")

    async def messages(request: web.Request) -> web.StreamResponse:
        """vLLM 0.32's `/v1/messages` shapes (entrypoints/anthropic): a message, or its
        stream of named events."""
        body = orjson.loads(await request.read())
        msg = {
            "id": f"msg_{name}_{next(_ids)}",
            "type": "message",
            "role": "assistant",
            "model": body.get("model", MODEL),
            "content": [{"type": "text", "text": name}],
            "stop_reason": "end_turn",
            "stop_sequence": None,
            "usage": {"input_tokens": 7, "output_tokens": 1},
        }
        if not body.get("stream"):
            return web.json_response(msg)
        s = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await s.prepare(request)
        events = (
            ("message_start", {"type": "message_start", "message": {**msg, "content": []}}),
            ("content_block_start", {"type": "content_block_start", "index": 0,
                                     "content_block": {"type": "text", "text": ""}}),
            ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                     "delta": {"type": "text_delta", "text": name}}),
            ("content_block_stop", {"type": "content_block_stop", "index": 0}),
            ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                               "usage": {"output_tokens": 1}}),
            ("message_stop", {"type": "message_stop"}),
        )  # fmt: skip
        for kind, ev in events:
            await s.write(b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(ev) + b"\n\n")
        await s.write_eof()
        return s

    async def count_tokens(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"input_tokens": 7})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/responses", responses)
    app.router.add_get("/v1/responses/{rid}", get_response)
    app.router.add_post("/v1/responses/{rid}/cancel", cancel)
    app.router.add_post("/v1/load_lora_adapter", load)
    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)
    web.run_app(app, host="127.0.0.1", port=port, print=None)


if __name__ == "__main__":
    main()
