"""Issue 14, the pure tier: defects of the attack run that need no process to reproduce."""

from __future__ import annotations

import pytest
import torch

from hearthnet.distributed_inference.generation import PromptLimits, SamplingParams
from hearthnet.distributed_inference.pipeline import DistributedChatParams
from hearthnet.distributed_inference.sanity import SanityChecker
from hearthnet.errors import BadRequest, ShardCorrupted, ShardUnavailable, error_from_code
from hearthnet.transport.codec import OP_INPUT, EncodedTensor, TensorAssembler


@pytest.mark.parametrize("details", [{"self": 1}, {"message": "x", "code": "y"},
                                     {"shard_id": "s", "reason": "r", "cls": 3}])
def test_peer_error_details_are_data_never_keyword_arguments(details):
    err = error_from_code("shard_unavailable", "busy", details)
    assert isinstance(err, ShardUnavailable) and err.message == "busy"
    assert err.details == details and err.code == "shard_unavailable"
    assert error_from_code("bad_config", "x", {"file": 1, "self": 2}).code == "bad_config"


@pytest.mark.parametrize("sampling", [{"top_k": 1.5}, {"seed": "abc"}, {"max_tokens": "9"},
                                      {"temperature": "hot"}, {"top_p": [1]},
                                      {"max_tokens": True}, {"stop": "abc"}, {"seed": 2**64}])
def test_sampling_parameters_are_type_checked_at_the_door(sampling):
    with pytest.raises(BadRequest):
        DistributedChatParams.from_dict({"sampling": sampling}, DistributedChatParams())


def test_sampling_parameters_of_the_right_types_pass():
    p = DistributedChatParams.from_dict({"sampling": {"top_k": 5, "seed": 3, "top_p": 1,
                                                      "temperature": 0.7, "stop": ["x"]}},
                                        DistributedChatParams())
    assert p.sampling.top_k == 5 and p.sampling.stop == ("x",)


def test_prompt_limits_name_the_limit():
    lim = PromptLimits(max_prompt_bytes=10, max_prompt_tokens=3, max_completion_tokens=4)
    msgs = [{"role": "user", "content": "é" * 6}]  # 12 bytes
    with pytest.raises(BadRequest, match="max_prompt_bytes = 10") as e:
        lim.check_request(msgs, SamplingParams(max_tokens=1))
    assert e.value.details["limit"] == "max_prompt_bytes"
    with pytest.raises(BadRequest, match="max_completion_tokens = 4"):
        lim.check_request([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=5))
    with pytest.raises(BadRequest, match="max_prompt_tokens = 3"):
        lim.check_prompt_ids([1, 2, 3, 4])
    lim.check_request([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=4))
    lim.check_prompt_ids([1, 2, 3])


def test_receive_buffer_grows_with_the_data_not_the_declared_size():
    big = torch.zeros(1, 4096, 64)  # 1 MiB declared
    enc = EncodedTensor(big, opcode=OP_INPUT, stream_id=1, step=0, start_pos=0,
                        chunk_bytes=4096)
    asm = TensorAssembler(chunk_bytes=4096)
    _, t = asm.feed(enc.frame(0))
    assert t is None and asm.buffered_bytes == 4096  # one chunk, not 1 MiB
    for i in range(1, len(enc.frames()) - 1):
        asm.feed(enc.frame(i))
    _, t = asm.feed(enc.frame(len(enc.frames()) - 1))
    assert t is not None and torch.equal(t, big)


def test_sanity_check_refuses_a_wrong_shape_or_dtype():
    c = SanityChecker(None)
    good = torch.zeros(1, 3, 8, dtype=torch.float16)
    c.check("s", 0, good, shape=(1, 3, 8), dtype=torch.float16)
    with pytest.raises(ShardCorrupted, match="shape") as e:
        c.check("s", 0, torch.zeros(1, 3, 7, dtype=torch.float16), shape=(1, 3, 8))
    assert e.value.details["check"] == "shape"
    with pytest.raises(ShardCorrupted, match=r"expected torch\.float16"):
        c.check("s", 0, good.float(), shape=(1, 3, 8), dtype=torch.float16)
