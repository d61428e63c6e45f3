"""``SpeculativeModel.generate`` takes what ``model.generate`` takes and returns what it returns,
or refuses a setting by name: every GenerationConfig field, stopping criteria, streamers,
keyword overrides and tokenizer outputs."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import GenerationConfig
from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

import heads
from conftest import build_model, left_pad, random_prompt
from heads.generation import HONOURED, NEUTRAL, NO_EFFECT

pytestmark = pytest.mark.fast  # in `make test-fast`


def _spec(name="llama", kind="lookup", **options):
    model = build_model(name, seed=7)
    defaults = {"tree": 8, "history_tokens": 0} if kind == "lookup" else {}  # no history: calls repeat exactly
    return model, heads.attach_heads(model, kind=kind, **defaults, **options)


def _prompt():
    return random_prompt(9, seed=3).repeat(1, 2)  # repeated text: lookup drafts and accepts


def test_every_generation_config_field_is_honoured_or_refused_by_name():
    fields = set(GenerationConfig().to_dict())
    unclassified = sorted(fields - HONOURED - NO_EFFECT - set(NEUTRAL))
    assert not unclassified, f"GenerationConfig fields with no policy in heads/generation.py: {unclassified}"
    assert not (HONOURED & NO_EFFECT) and not (HONOURED & set(NEUTRAL)) and not (NO_EFFECT & set(NEUTRAL))


@pytest.mark.parametrize("field, value", [("num_beams", 4), ("bad_words_ids", [[5]]), ("num_return_sequences", 2),
                                          ("forced_eos_token_id", 3), ("output_scores", True),
                                          ("return_dict_in_generate", True), ("min_p", 0.1)])
def test_refused_fields_name_themselves(field, value):
    model, spec = _spec()
    with pytest.raises(NotImplementedError, match=field):
        spec.generate(_prompt(), max_new_tokens=8, **{field: value})
    model.generation_config = copy.deepcopy(model.generation_config)
    setattr(model.generation_config, field, value)
    with pytest.raises(NotImplementedError, match=f"generation_config.{field}"):
        spec.generate(_prompt(), max_new_tokens=8)


def test_generation_config_max_new_tokens_and_max_length_are_honoured():
    model, spec = _spec()
    prompt = _prompt()
    model.generation_config.max_new_tokens = 5
    out = spec.generate(prompt)
    assert out.shape[1] == prompt.shape[1] + 5
    assert torch.equal(out, model.generate(prompt, do_sample=False))
    model.generation_config.max_new_tokens = None
    model.generation_config.max_length = prompt.shape[1] + 7
    assert torch.equal(spec.generate(prompt), model.generate(prompt, do_sample=False))
    assert torch.equal(spec.generate(prompt, max_length=prompt.shape[1] + 3),
                       model.generate(prompt, do_sample=False, max_length=prompt.shape[1] + 3))
    config = GenerationConfig(max_new_tokens=4, do_sample=False)
    assert spec.generate(prompt, generation_config=config).shape[1] == prompt.shape[1] + 4


def test_generation_config_temperature_is_honoured_when_sampling():
    model, spec = _spec()
    prompt = _prompt()
    model.generation_config.temperature = 0.5
    model.generation_config.top_k = 0
    from_config = spec.generate(prompt, do_sample=True, max_new_tokens=12, generator=torch.Generator().manual_seed(4))
    key_from_config = spec.last_stats is not None
    explicit = spec.generate(prompt, do_sample=True, temperature=0.5, top_k=0, max_new_tokens=12,
                             generator=torch.Generator().manual_seed(4))
    assert key_from_config and torch.equal(from_config, explicit)
    other = [spec.generate(prompt, do_sample=True, temperature=2.0, top_k=0, max_new_tokens=12,
                           generator=torch.Generator().manual_seed(seed)) for seed in range(4)]
    assert any(not torch.equal(sample, explicit) for sample in other)


class StopAfterToken(StoppingCriteria):
    def __init__(self, token: int) -> None:
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


@pytest.mark.parametrize("name", ["llama", "gpt2", "mistral"])
def test_stopping_criteria_cut_where_generate_cuts(name):
    model = build_model(name, seed=7)
    prompt = _prompt()
    full = model.generate(prompt, do_sample=False, max_new_tokens=30)[0, prompt.shape[1]:].tolist()
    # the corpus holds the continuation, so the stop lands inside an accepted chunk
    spec = heads.attach_heads(model, kind="lookup", tree=8, history_tokens=10_000,
                              corpus=[prompt[0].tolist() + full])
    fresh = [index for index in range(3, len(full)) if full[index] not in full[:index]]
    token = full[fresh[0] if fresh else len(full) // 2]
    criteria = StoppingCriteriaList([StopAfterToken(token)])
    expected = model.generate(prompt, do_sample=False, max_new_tokens=30, stopping_criteria=criteria)
    assert torch.equal(spec.generate(prompt, max_new_tokens=30, stopping_criteria=criteria), expected)
    assert spec.last_stats.mean_accepted > 1.0


class Collect(BaseStreamer):
    def __init__(self) -> None:
        self.chunks, self.ended = [], False

    def put(self, value):
        self.chunks.append(value.reshape(-1).tolist())

    def end(self):
        self.ended = True


def test_streamer_gets_the_prompt_then_each_committed_chunk():
    model, spec = _spec()
    prompt = _prompt()
    streamer = Collect()
    out = spec.generate(prompt, max_new_tokens=20, streamer=streamer)
    assert streamer.ended and streamer.chunks[0] == prompt[0].tolist()
    assert sum(streamer.chunks[1:], []) == out[0, prompt.shape[1]:].tolist()
    assert any(len(chunk) > 1 for chunk in streamer.chunks[1:])  # accepted drafts arrive as chunks
    with pytest.raises(ValueError, match="batch 1"):
        spec.generate(prompt.repeat(2, 1), max_new_tokens=4, streamer=Collect())


def test_eos_and_pad_overrides_and_tokenizer_outputs():
    model, spec = _spec("qwen2")
    prompt = _prompt()
    plain = model.generate(prompt, do_sample=False, max_new_tokens=16)[0, prompt.shape[1]:].tolist()
    eos = plain[5]
    expected = model.generate(prompt, do_sample=False, max_new_tokens=16, eos_token_id=eos, pad_token_id=3)
    assert torch.equal(spec.generate(prompt, max_new_tokens=16, eos_token_id=eos, pad_token_id=3), expected)
    ids, mask = left_pad([random_prompt(5, seed=1)[0], random_prompt(9, seed=2)[0]])
    batch = {"input_ids": ids, "attention_mask": mask}
    assert torch.equal(spec.generate(**batch, max_new_tokens=10, eos_token_id=eos, pad_token_id=3),
                       model.generate(**batch, do_sample=False, max_new_tokens=10, eos_token_id=eos, pad_token_id=3))
    with pytest.raises(TypeError, match="token_type_ids"):
        spec.generate(**batch, token_type_ids=torch.zeros_like(ids), max_new_tokens=4)
    with pytest.raises(TypeError, match="max_new_token"):
        spec.generate(prompt, max_new_token=4)
    with pytest.raises(TypeError, match="GenerationConfig"):
        spec.generate(prompt, generation_config={"max_new_tokens": 3})


def test_a_request_past_the_position_table_is_refused_up_front():
    model, spec = _spec("gpt2")  # n_positions 256
    prompt = random_prompt(250, seed=1)
    with pytest.raises(ValueError, match="exceeds this model's 256 positions"):
        spec.generate(prompt, max_new_tokens=10)
    assert spec.generate(prompt, max_new_tokens=6).shape[1] == 256


def test_inputs_is_another_name_for_input_ids():
    """issue 36 item 11: ``model.generate(inputs=ids)`` works, ``spec.generate(inputs=ids)`` said it needs input_ids."""
    model, spec = _spec()
    prompt = _prompt()
    expected = model.generate(inputs=prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                              max_new_tokens=10)
    assert torch.equal(spec.generate(inputs=prompt, max_new_tokens=10), expected)
    with pytest.raises(ValueError, match="input_ids and as inputs="):
        spec.generate(prompt, inputs=prompt, max_new_tokens=4)


@pytest.mark.parametrize("kind", ["lookup", "medusa"])
def test_a_logits_processor_list_of_known_processors_is_honoured(kind):
    """issue 36 item 13: processors that GenerationConfig fields build are honoured as those fields,
    with the same output as ``model.generate(logits_processor=...)``; an empty list or None changes nothing."""
    from transformers.generation.logits_process import (
        LogitsProcessorList, MinNewTokensLengthLogitsProcessor, NoRepeatNGramLogitsProcessor,
        SuppressTokensLogitsProcessor,
    )

    model, spec = _spec(kind=kind)
    model.generation_config.eos_token_id = 5
    prompt = _prompt()
    width = prompt.shape[1]
    plain = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=12)
    for empty in (None, LogitsProcessorList(), []):
        assert torch.equal(spec.generate(prompt, max_new_tokens=12, logits_processor=empty), plain)
    processors = LogitsProcessorList([NoRepeatNGramLogitsProcessor(2), SuppressTokensLogitsProcessor([7, 9]),
                                      MinNewTokensLengthLogitsProcessor(width, 6, [5])])
    expected = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=12,
                              logits_processor=processors)
    assert torch.equal(spec.generate(prompt, max_new_tokens=12, logits_processor=processors), expected)


@pytest.mark.parametrize("custom, options", [("length", dict(min_new_tokens=3)), ("new", dict(min_length=30)),
                                             ("length", dict(min_length=22))])
def test_custom_minimum_lengths_combine_with_the_fields_as_in_generate(custom, options):
    """A custom processor replaces the field's processor of its own class only: a custom MinLength
    with min_new_tokens set bans eos below both lengths, as ``generate`` does."""
    from transformers.generation.logits_process import MinLengthLogitsProcessor, MinNewTokensLengthLogitsProcessor

    model, spec = _spec()
    prompt = _prompt()
    eos = model.generation_config.eos_token_id = 40  # written at a length between 21 and 26: the bans decide
    processor = (MinLengthLogitsProcessor(prompt.shape[1] + 8, [eos]) if custom == "length"
                 else MinNewTokensLengthLogitsProcessor(prompt.shape[1], 8, [eos]))
    expected = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=16,
                              logits_processor=[processor], **options)
    assert torch.equal(spec.generate(prompt, max_new_tokens=16, logits_processor=[processor], **options), expected)


def test_other_logits_processors_and_prefix_functions_are_refused_by_name():
    from transformers.generation.logits_process import (
        LogitsProcessorList, RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor,
    )

    model, spec = _spec()
    prompt = _prompt()
    with pytest.raises(NotImplementedError, match="SequenceBiasLogitsProcessor is not supported"):
        spec.generate(prompt, max_new_tokens=4,
                      logits_processor=LogitsProcessorList([SequenceBiasLogitsProcessor({(5,): 2.0})]))
    with pytest.raises(NotImplementedError, match="RepetitionPenaltyLogitsProcessor.*repetition_penalty="):
        spec.generate(prompt, max_new_tokens=4, logits_processor=[RepetitionPenaltyLogitsProcessor(1.2)])
    with pytest.raises(NotImplementedError, match="prefix_allowed_tokens_fn"):
        spec.generate(prompt, max_new_tokens=4, prefix_allowed_tokens_fn=lambda batch, ids: [1, 2])
    with pytest.raises(TypeError, match="logits_processor must be"):
        spec.generate(prompt, max_new_tokens=4, logits_processor=3)
