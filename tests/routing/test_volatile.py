"""Volatile-prefix rules: what they drop from system blocks and strings, and the chat key without them."""

from __future__ import annotations

import copy
from typing import Any

from routing.keys import chat_key
from routing.volatile import BILLING_PREFIX, NO_RULES, VolatileRules, rules_for

RULES = VolatileRules()


def billing(nonce: str) -> dict[str, str]:
    text = f"{BILLING_PREFIX} cc_version=2.1.37.abc; cc_entrypoint=cli; cch={nonce};"
    return {"type": "text", "text": text}


SYSTEM = {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}


def test_drop_removes_only_volatile_text_blocks_and_keeps_the_order_of_the_rest() -> None:
    image = {"type": "image", "source": {"type": "url", "url": "http://127.0.0.1/x.png"}}
    blocks: list[Any] = [billing("1"), SYSTEM, image, "not a block", {"type": "text", "text": 5}]
    before = copy.deepcopy(blocks)
    assert RULES.drop(blocks) == [SYSTEM, image, "not a block", {"type": "text", "text": 5}]
    assert blocks == before  # nothing given is mutated


def test_drop_returns_the_same_list_when_nothing_is_volatile() -> None:
    blocks: list[Any] = [SYSTEM, {"type": "text", "text": "x-anthropic-billing-header without colon"}]
    assert RULES.drop(blocks) is blocks
    assert NO_RULES.drop([billing("1")]) == [billing("1")]
    assert not NO_RULES and RULES


def test_a_block_must_start_with_the_prefix_and_be_a_text_block() -> None:
    assert RULES.drop([{"type": "text", "text": " " + billing("1")["text"]}]) != []
    assert RULES.drop([{"type": "document", "text": billing("1")["text"]}]) != []


def test_drop_text_removes_a_volatile_first_line_or_the_whole_one_line_string() -> None:
    line = billing("9")["text"]
    assert RULES.drop_text(line) == ""
    assert RULES.drop_text(line + "\nYou are Claude Code.\nBe brief.") == "You are Claude Code.\nBe brief."
    text = "You are Claude Code.\n" + line
    assert RULES.drop_text(text) is text  # only a leading block is one


def test_drop_content_reads_strings_lists_and_leaves_anything_else() -> None:
    assert RULES.drop_content([billing("1"), SYSTEM]) == [SYSTEM]
    assert RULES.drop_content(billing("1")["text"]) == ""
    assert RULES.drop_content(None) is None


def test_several_prefixes_and_without() -> None:
    rules = VolatileRules((BILLING_PREFIX, "Current time:"))
    blocks: list[Any] = [billing("1"), {"type": "text", "text": "Current time: 12:00"}, SYSTEM]
    assert rules.drop(blocks) == [SYSTEM]
    engine_keeps = rules.without((BILLING_PREFIX,))
    assert engine_keeps == VolatileRules(("Current time:",))
    assert engine_keeps.drop(blocks) == [billing("1"), SYSTEM]
    assert not RULES.without((BILLING_PREFIX,))
    assert rules_for((BILLING_PREFIX,)) is rules_for((BILLING_PREFIX,))


def test_present_finds_volatile_text_in_an_anthropic_system_or_a_chat_system_message() -> None:
    assert RULES.present({"system": [billing("1"), SYSTEM], "messages": []})
    assert RULES.present({"system": billing("1")["text"]})
    assert not RULES.present({"system": [SYSTEM], "messages": [{"role": "user", "content": "hi"}]})
    chat = {"messages": [{"role": "developer", "content": [billing("1")]}, {"role": "user", "content": "q"}]}
    assert RULES.present(chat)
    later = {"messages": [{"role": "user", "content": "q"}, {"role": "system", "content": [billing("1")]}]}
    assert not RULES.present(later)  # only the leading system messages are the system prompt
    assert not NO_RULES.present({"system": [billing("1")]})


def chat_body(system: Any) -> dict[str, Any]:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "q"}]
    return {"model": "m", "messages": messages}


def test_the_chat_key_leaves_volatile_blocks_out_so_every_turn_keys_alike() -> None:
    one, two = chat_body([billing("1"), SYSTEM]), chat_body([billing("2"), SYSTEM])
    assert chat_key(one) != chat_key(two)  # without rules the nonce changes the key every request
    assert chat_key(one, RULES) == chat_key(two, RULES) == chat_key(chat_body([SYSTEM]), RULES)
    line = billing("3")["text"] + "\nYou are Claude Code."
    assert chat_key(chat_body(line), RULES) == chat_key(chat_body("You are Claude Code."), RULES)


def test_the_chat_key_is_unchanged_for_bodies_without_volatile_text() -> None:
    body = chat_body([SYSTEM])
    assert chat_key(body, RULES) == chat_key(body)
    user = {"model": "m", "messages": [{"role": "user", "content": billing("1")["text"]}]}
    assert chat_key(user, RULES) == chat_key(user)  # user text is never volatile
