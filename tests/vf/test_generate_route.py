"""verifiers' own ``renderers`` client (``renderers.client.generate``, what its train client calls)
against primerl's embedded engine server over real HTTP: the rendered prompt goes in, the sampled
token ids, log-probs, finish reason and routed experts come back parsed by the client."""

import asyncio
import binascii

import numpy as np
import pytest
import torch
from openai import AsyncOpenAI
from renderers import create_renderer
from renderers.client import generate
from renderers.configs import Qwen3RendererConfig
from transformers import AutoTokenizer

from primerl.models.config import MoETransformerConfig
from primerl.models.transformer import MoETransformer
from primerl.runtime.inference.engine import InferenceEngine, Request, SamplingParams
from primerl.runtime.inference.server import EngineServer
from primerl.rl.envs.vf_tokenizer import QWEN3_TINY_VOCAB, build_qwen3_tokenizer


def _engine():
    torch.manual_seed(0)
    m = MoETransformer(MoETransformerConfig.tiny(vocab_size=QWEN3_TINY_VOCAB))
    m.init_weights(seed=0)
    return InferenceEngine(m, max_batch_size=8)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return AutoTokenizer.from_pretrained(build_qwen3_tokenizer(tmp_path_factory.mktemp("tok")))


@pytest.mark.parametrize("http", ["aiohttp", "stdlib"])
def test_renderers_client_reads_the_generate_route(tokenizer, http):
    srv = EngineServer(_engine(), http=http, model_name="tiny").start()
    renderer = create_renderer(tokenizer, Qwen3RendererConfig(enable_thinking=False))
    messages = [{"role": "user", "content": "Reverse: abc"}]

    async def go():
        client = AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        try:
            return await generate(client=client, renderer=renderer, messages=messages, model="tiny",
                                  sampling_params={"temperature": 1.0, "max_tokens": 12, "seed": 5, "top_k": -1},
                                  extra_headers={"X-Session-ID": "trace-a"})
        finally:
            await client.close()

    try:
        out = asyncio.run(go())
        prompt = renderer.render(messages, add_generation_prompt=True).token_ids
        stops = renderer.get_stop_token_ids()
        ref = _engine().generate([Request(0, prompt, SamplingParams(max_new_tokens=12, temperature=1.0,
                                                                    stop_token_ids=tuple(stops), seed=5))])[0]
        assert out["prompt_ids"] == prompt
        assert out["completion_ids"] == ref.tokens  # the sampled stop token included when it stopped
        assert out["completion_logprobs"] == pytest.approx(ref.logprobs, abs=1e-6)
        assert out["finish_reason"] == ref.finish_reason
        re = out["routed_experts"]
        assert isinstance(re["data"], memoryview)  # compact JSON: the client spliced the base64 out unparsed
        arr = np.frombuffer(binascii.a2b_base64(re["data"]), dtype=np.uint8).reshape(re["shape"])
        assert torch.equal(torch.from_numpy(arr.copy()), ref.routing.to(torch.uint8))
        assert srv.session_versions("trace-a") == (0, 0, 1)
    finally:
        srv.stop()
