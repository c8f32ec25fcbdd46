from typing import Any

from backends.sim.tokens import (
    MEDIA_TOKENS_MIN,
    MEDIA_TOKENS_SPREAD,
    media_token_count,
    render_chat,
    tokenize,
)


def test_tokens_are_markers_and_whitespace_separated_runs() -> None:
    assert tokenize("Hello, world!\n  foo") == ["Hello,", "world!", "foo"]
    assert tokenize("<|im_start|>user\nhi<|im_end|>\n") == ["<|im_start|>", "user", "hi", "<|im_end|>"]
    assert tokenize("") == []


def test_each_message_costs_three_template_tokens_plus_generation_prompt() -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a b c"}]
    assert len(tokenize(render_chat(messages))) == (3 + 2) + (3 + 3) + 2
    assert len(tokenize(render_chat(messages, add_generation_prompt=False))) == 11


def test_a_later_turn_extends_the_earlier_prompt() -> None:
    turn1 = [{"role": "user", "content": "what is a prefix cache"}]
    turn2 = [*turn1, {"role": "assistant", "content": "it keeps kv"}, {"role": "user", "content": "more"}]
    first, second = tokenize(render_chat(turn1)), tokenize(render_chat(turn2))
    assert second[: len(first)] == first
    assert second[len(first) : len(first) + 3] == ["it", "keeps", "kv"]


def test_continue_final_message_leaves_the_last_turn_open() -> None:
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "partial"}]
    assert render_chat(messages, continue_final_message=True).endswith("<|im_start|>assistant\npartial")


def test_images_cost_a_fixed_token_count_per_url_and_differ_by_url() -> None:
    def parts(url: str) -> list[object]:
        return [{"type": "text", "text": "see"}, {"type": "image_url", "image_url": {"url": url}}]

    a1 = tokenize(render_chat([{"role": "user", "content": parts("data:image/png;base64,AAAA")}]))
    a2 = tokenize(render_chat([{"role": "user", "content": parts("data:image/png;base64,AAAA")}]))
    b = tokenize(render_chat([{"role": "user", "content": parts("data:image/png;base64,BBBB")}]))
    count = media_token_count({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}})
    assert MEDIA_TOKENS_MIN <= count < MEDIA_TOKENS_MIN + MEDIA_TOKENS_SPREAD
    assert a1 == a2
    assert len(a1) == 3 + 1 + count + 2
    assert a1 != b
    media = [t for t in a1 if t.startswith("<|media_")]
    assert len(set(media)) == count  # distinct tokens: a run of image blocks never aliases another


def test_image_embeds_parts_hash_their_payload() -> None:
    part = {"type": "image_embeds", "image_embeds": {"image_embeds": "QUJD", "image_grid_thw": "eHl6"}}
    same = {"type": "image_embeds", "image_embeds": {"image_grid_thw": "eHl6", "image_embeds": "QUJD"}}
    other = {"type": "image_embeds", "image_embeds": {"image_embeds": "REVG", "image_grid_thw": "eHl6"}}

    def render(part: Any) -> str:
        return render_chat([{"role": "user", "content": [part]}])

    assert render(part) == render(same)
    assert render(part) != render(other)
