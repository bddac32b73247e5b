"""Where each multimodal item sits in the prompt: found where the HF processor already expanded it,
or placed by applying the model's prompt updates (tokens first, then the text fallback).

Discovery follows vLLM 0.9's `find_mm_placeholders`: one left-to-right scan; at each position the
first modality (in the order the model declared its updates) whose next item's content starts
there claims those tokens, so a run is never counted for two modalities, and each modality's items
are found in item order. The result can be partial, which lets an error name the first missing
item. Where vLLM would go on with a wrong prompt, Tessera stops with an error instead.
"""

from __future__ import annotations

from collections.abc import Sequence

from .inputs import PlaceholderRange
from .prompt_matching import (
    Edit,
    Placeholders,
    ResolvedUpdate,
    ResolvedUpdates,
    TargetMatch,
    find_seq,
    find_target_matches,
    plan_edits,
    splice,
)
from .prompt_updates import BoundPromptSequence, PromptIndex, TokenCodec, UpdateMode

Span = tuple[int, int]


def place_items(
    token_ids: list[int], resolved: ResolvedUpdates, codec: TokenCodec, *, maybe_applied: bool
) -> tuple[list[int], Placeholders]:
    """Token ids with every item's placeholder tokens in them, and where they are (by item)."""
    found: Placeholders = {}
    if maybe_applied:
        found = {m: ranges for m, ranges in find_placeholders(token_ids, resolved).items() if ranges}
        for modality in found:
            _refuse_wrong_expansion(token_ids, resolved, found, modality, codec)
        _refuse_longer_runs(token_ids, found)
    # A modality the HF processor did not expand at all (e.g. precomputed embeddings): expand it here.
    to_apply = {m: candidates for m, candidates in resolved.items() if m not in found}
    if not to_apply:
        return list(token_ids), found
    new_ids, applied = apply_prompt_updates(token_ids, to_apply, codec)
    if found:  # the expanded items moved: find them again, around the runs just placed
        spans = [(p.offset, p.offset + p.length) for ranges in applied.values() for p in ranges]
        found = find_placeholders(new_ids, {m: resolved[m] for m in found}, claimed=spans)
        for modality, ranges in found.items():
            if len(ranges) != len(resolved[modality][0]):  # only a re-tokenized text fallback can do this
                raise ValueError(
                    f"The {modality} tokens that the HF processor expanded changed when the tokens of "
                    f"{', '.join(to_apply)} were placed; put whitespace around the placeholders."
                )
    return new_ids, {m: found.get(m) or applied[m] for m in resolved}


# ---- discovery ---------------------------------------------------------------------------------


def find_placeholders(token_ids: list[int], resolved: ResolvedUpdates, *, claimed: Sequence[Span] = ()) -> Placeholders:
    """Each modality's items found in `token_ids`, in item order (maybe fewer than its items).

    `claimed` spans belong to something else and are never matched. Empty contents never match.
    """
    found: Placeholders = {m: [] for m in resolved}
    blocked = sorted(claimed)
    memo: dict[tuple[str, int], tuple[int, int]] = {}  # (modality, update) -> (item, next start)
    pos = 0
    while True:
        best: tuple[int, ResolvedUpdate] | None = None
        for modality, candidates in resolved.items():
            i = len(found[modality])
            if i >= len(candidates[0]):
                continue
            for update_idx, items in enumerate(candidates):
                key = (modality, update_idx)
                item_idx, start = memo.get(key, (-1, 0))
                if item_idx != i or 0 <= start < pos:  # stale: search again from here
                    start = _find_free(token_ids, items[i].content.token_ids, pos, blocked)
                    memo[key] = (i, start)
                if start >= 0 and (best is None or start < best[0]):  # ties: first declared wins
                    best = (start, items[i])
        if best is None:
            return found
        start, item = best
        found[item.modality].append(item.placeholder(start))
        pos = start + len(item.content.token_ids)


def _find_free(seq: list[int], needle: list[int], pos: int, blocked: Sequence[Span]) -> int:
    """First occurrence of non-empty `needle` at or after `pos` that touches no blocked span, or -1."""
    if not needle:
        return -1
    while (i := find_seq(seq, needle, pos)) >= 0:
        end = i + len(needle)
        if not any(s < end and i < e for s, e in blocked):
            return i
        pos = i + 1
    return -1


def _refuse_wrong_expansion(
    token_ids: list[int], resolved: ResolvedUpdates, found: Placeholders, modality: str, codec: TokenCodec
) -> None:
    """Some but not all items expanded, or more expanded runs than items: name what is wrong."""
    candidates, ranges = resolved[modality], found[modality]
    expected = len(candidates[0])
    if len(ranges) < expected:
        if _replaces_sequences(candidates):
            raise placeholder_count_error(modality, expected, len(ranges), describe_targets(candidates, codec))
        raise ValueError(
            f"The processed prompt holds the tokens of {len(ranges)} of {expected} {modality} item(s); "
            f"{_missing(modality, len(ranges), expected)}."
        )
    extra = _count_unclaimed(token_ids, candidates, found, ranges[-1].offset + ranges[-1].length)
    if extra and _replaces_sequences(candidates):
        raise placeholder_count_error(modality, expected, expected + extra, describe_targets(candidates, codec))
    if extra:
        raise ValueError(
            f"The processed prompt holds the tokens of {expected + extra} {modality} item(s) "
            f"but {expected} {modality} item(s) were given."
        )


def _refuse_longer_runs(token_ids: list[int], found: Placeholders) -> None:
    """An embedding token right next to a found placeholder (and in no other): the HF processor
    expanded the item to more tokens than the model's prompt update gives, e.g. when processor
    kwargs change the expansion but not the model. vLLM would leave the extra tokens as text."""
    spans = sorted((p.offset, p.offset + p.length) for ranges in found.values() for p in ranges)

    def claimed(i: int) -> bool:
        return any(s <= i < e for s, e in spans)

    for modality, ranges in found.items():
        for index, p in enumerate(ranges):
            run = token_ids[p.offset : p.offset + p.length]
            embed = {t for t, e in zip(run, p.is_embed.tolist() if p.is_embed is not None else [True] * len(run)) if e}
            for neighbour in (p.offset - 1, p.offset + p.length):
                if 0 <= neighbour < len(token_ids) and token_ids[neighbour] in embed and not claimed(neighbour):
                    raise ValueError(
                        f"The HF processor expanded {modality} item {index} (counting from 0) to more tokens than "
                        f"the model's prompt update gives ({p.length}); processor kwargs that change how items "
                        f"expand (e.g. {modality} size or feature strategy) must also be the model's."
                    )


def _count_unclaimed(token_ids: list[int], candidates, found: Placeholders, pos: int) -> int:
    """Further runs of the last item's content after `pos` (HF expanded a placeholder with no item)."""
    blocked = sorted((p.offset, p.offset + p.length) for ranges in found.values() for p in ranges)
    contents = [items[-1].content.token_ids for items in candidates]
    count = 0
    while True:
        starts = [(s, len(c)) for c in contents if (s := _find_free(token_ids, c, pos, blocked)) >= 0]
        if not starts:
            return count
        start, length = min(starts)
        count, pos = count + 1, start + length


# ---- applying ----------------------------------------------------------------------------------


def apply_prompt_updates(
    token_ids: list[int], resolved: ResolvedUpdates, codec: TokenCodec
) -> tuple[list[int], Placeholders]:
    """Apply every item's update to `token_ids`; returns the new ids and the placeholders."""
    if not resolved:
        return list(token_ids), {}
    matches = find_target_matches(token_ids, resolved, codec)
    _refuse_unused_targets(matches, resolved, codec)
    edits, placed = plan_edits(matches, resolved)
    if all(placed[m] == len(c[0]) for m, c in resolved.items()):
        new_ids, offsets = splice(token_ids, edits)
        return new_ids, _placeholders(edits, offsets, resolved)

    # Text fallback: some target only exists inside larger tokens (or is empty text).
    text = codec.decode(token_ids)
    matches = find_target_matches(text, resolved, codec)
    _refuse_unused_targets(matches, resolved, codec)
    edits, placed = plan_edits(matches, resolved)
    for modality, candidates in resolved.items():
        if placed[modality] < len(candidates[0]):
            raise _unplaced_error(modality, candidates, placed[modality], codec)
    new_text, _ = splice(text, edits)
    new_ids = codec.tokenizer.encode(new_text, add_special_tokens=False)
    offsets, cursor = [], 0
    for edit in edits:  # each edit's items lie together, in order, somewhere after the previous edit
        content = [t for item in edit.items for t in item.content.token_ids]
        start = find_seq(new_ids, content, cursor) if content else cursor
        if start < 0:
            item = edit.items[0]
            raise ValueError(
                f"The {item.modality} tokens of item {item.item_idx} merged with the text around them when the "
                "prompt was tokenized; put whitespace around the placeholder."
            )
        offsets.append(start)
        cursor = start + len(content)
    return new_ids, _placeholders(edits, offsets, resolved)


def _placeholders(edits: Sequence[Edit], offsets: Sequence[int], resolved: ResolvedUpdates) -> Placeholders:
    by_item: dict[str, dict[int, PlaceholderRange]] = {m: {} for m in resolved}
    for edit, offset in zip(edits, offsets):
        for item in edit.items:
            if not item.content.token_ids:  # vLLM cannot find such an item afterwards either
                raise ValueError(
                    f"The model's prompt update gives {item.modality} item {item.item_idx} no tokens; an item "
                    "needs at least one placeholder token."
                )
            by_item[item.modality][item.item_idx] = item.placeholder(offset)
            offset += len(item.content.token_ids)
    return {m: [ranges[i] for i in sorted(ranges)] for m, ranges in by_item.items()}


def _refuse_unused_targets(matches: Sequence[TargetMatch], resolved: ResolvedUpdates, codec: TokenCodec) -> None:
    """More placeholders than items: vLLM leaves the extra ones in the prompt, as text tokens."""
    for modality, candidates in resolved.items():
        spans = [m for m in matches if m.modality == modality]
        if _replaces_sequences(candidates) and all(m.end > m.start for m in spans) and len(spans) > len(candidates[0]):
            raise placeholder_count_error(modality, len(candidates[0]), len(spans), describe_targets(candidates, codec))


def _unplaced_error(modality: str, candidates, placed: int, codec: TokenCodec) -> ValueError:
    target = describe_targets(candidates, codec)
    if _replaces_sequences(candidates):
        return placeholder_count_error(modality, len(candidates[0]), placed, target)
    return ValueError(f"Cannot place the {modality} tokens: {target} was not found in the prompt.")


# ---- wording -----------------------------------------------------------------------------------


def _replaces_sequences(candidates: Sequence[Sequence[ResolvedUpdate]]) -> bool:
    """Every update replaces a text/token target: then each item needs one placeholder of its own."""
    return all(
        items[0].mode == UpdateMode.REPLACE and not isinstance(items[0].target, PromptIndex) for items in candidates
    )


def describe_targets(candidates: Sequence[Sequence[ResolvedUpdate]], codec: TokenCodec) -> str:
    names = [describe_target(items[0].target, codec) for items in candidates]
    return " or ".join(dict.fromkeys(names))


def describe_target(target, codec: TokenCodec) -> str:
    if isinstance(target, PromptIndex):
        return target.description
    return repr(BoundPromptSequence(codec, target).text)


def placeholder_count_error(modality: str, expected: int, found: int, target: str) -> ValueError:
    if found < expected:
        detail = _missing(modality, found, expected)
    else:
        detail = f"{found - expected} placeholder(s) have no {modality} to go with them"
    return ValueError(
        f"The prompt has {found} {modality} placeholder(s) ({target}) but {expected} {modality} item(s) were given; "
        f"{detail}. Put exactly one {target} in the prompt for each {modality}."
    )


def _missing(modality: str, found: int, expected: int) -> str:
    if expected - found == 1:
        return f"{modality} item {found} (counting from 0) has none"
    return f"{modality} items {found} to {expected - 1} (counting from 0) have none"
