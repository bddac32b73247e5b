"""Finding and applying prompt updates on token ids, with a text fallback.

Rules (per modality, items in order): item i takes the i-th non-overlapping match of the
target, left to right. A replacement swaps the match for the item's tokens; an insertion goes
right after the match, and when there are fewer matches than items all insertions go, in item
order, after the first match. Matching runs on token ids; if some item's target is not found
there (e.g. the target text sits inside a larger token), the prompt is decoded, matched as
text and encoded again.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Optional, Union

from .inputs import PlaceholderRange
from .prompt_updates import (
    BoundPromptSequence,
    PromptIndex,
    PromptSeq,
    PromptTarget,
    PromptUpdate,
    PromptUpdateDetails,
    TokenCodec,
    UpdateMode,
)


@dataclass
class ResolvedUpdate:
    """One update bound to one item: where it goes and what it inserts."""

    modality: str
    item_idx: int
    mode: UpdateMode
    target: PromptTarget
    content: BoundPromptSequence
    details: PromptUpdateDetails

    def placeholder(self, offset: int) -> PlaceholderRange:
        is_embed = self.details.is_embed(self.content) if self.details.is_embed is not None else None
        return PlaceholderRange(offset=offset, length=len(self.content.token_ids), is_embed=is_embed)


# modality -> candidate updates -> one resolved update per item
ResolvedUpdates = Mapping[str, Sequence[Sequence[ResolvedUpdate]]]
Placeholders = dict[str, list[PlaceholderRange]]


def resolve_updates(
    updates: Sequence[PromptUpdate], item_counts: Mapping[str, int], codec: TokenCodec
) -> dict[str, list[list[ResolvedUpdate]]]:
    resolved: dict[str, list[list[ResolvedUpdate]]] = {}
    for update in updates:
        count = item_counts.get(update.modality, 0)
        items = []
        for i in range(count):
            details = update.resolve(i)
            content = BoundPromptSequence(codec, details.full)
            items.append(ResolvedUpdate(update.modality, i, update.mode, update.target, content, details))
        if count:
            resolved.setdefault(update.modality, []).append(items)
    for modality, count in item_counts.items():
        if count and modality not in resolved:
            raise ValueError(f"The model's processor declares no prompt update for {modality} items.")
    return resolved


def describe_target(target: PromptTarget, codec: TokenCodec) -> str:
    if isinstance(target, PromptIndex):
        return "a position in the prompt"
    return repr(BoundPromptSequence(codec, target).text)


def placeholder_count_error(modality: str, expected: int, found: int, target: str) -> ValueError:
    return ValueError(
        f"The prompt has {found} {modality} placeholder(s) ({target}) but {expected} {modality} item(s) "
        f"were given; put exactly one {target} in the prompt for each {modality}."
    )


def _find_all(seq: PromptSeq, needle: PromptSeq, start: int = 0) -> list[tuple[int, int]]:
    """Non-overlapping occurrences of `needle` in `seq` as (start, end), left to right."""
    if len(needle) == 0:
        return []
    out = []
    i, n = start, len(needle)
    while True:
        i = _find(seq, needle, i)
        if i < 0:
            return out
        out.append((i, i + n))
        i += n


def _find(seq: PromptSeq, needle: PromptSeq, start: int) -> int:
    if isinstance(seq, str):
        return seq.find(needle, start)  # type: ignore[arg-type]
    if len(needle) == 0:
        return start
    first, n = needle[0], len(needle)
    i = start
    while i <= len(seq) - n:
        try:
            i = seq.index(first, i)  # C-speed scan for the first token
        except ValueError:
            return -1
        if seq[i : i + n] == needle:
            return i
        i += 1
    return -1


def _target_matches(prompt: PromptSeq, target: PromptTarget, codec: TokenCodec) -> list[tuple[int, int]]:
    if isinstance(target, PromptIndex):
        index = target.get_match_index(codec.tokenizer, prompt)
        return [] if index is None else [(index, index)]
    bound = BoundPromptSequence(codec, target)
    return _find_all(prompt, bound.text if isinstance(prompt, str) else bound.token_ids)


@dataclass
class _Edit:
    start: int
    end: int
    update: ResolvedUpdate


def _plan_edits(prompt: PromptSeq, resolved: ResolvedUpdates, codec: TokenCodec, *, strict: bool):
    """Edits for every item, or None when some target is missing (and `strict` is False)."""
    edits: list[_Edit] = []
    for modality, candidates in resolved.items():
        planned = None
        for items in candidates:
            matches = _target_matches(prompt, items[0].target, codec)
            planned = _assign(matches, items)
            if planned is not None:
                break
            found = len(matches)
        if planned is None:
            if not strict:
                return None
            items = candidates[0]
            if items[0].mode == UpdateMode.INSERT:
                target = describe_target(items[0].target, codec)
                raise ValueError(f"Cannot place the {modality} tokens: {target} is not in the prompt.")
            raise placeholder_count_error(modality, len(items), found, describe_target(items[0].target, codec))
        edits.extend(planned)
    edits.sort(key=lambda e: (e.start, e.end))
    for prev, cur in zip(edits, edits[1:]):
        if cur.start < prev.end:
            raise ValueError(
                f"Prompt updates for {prev.update.modality} item {prev.update.item_idx} and "
                f"{cur.update.modality} item {cur.update.item_idx} overlap."
            )
    return edits


def _assign(matches: list[tuple[int, int]], items: Sequence[ResolvedUpdate]) -> Optional[list[_Edit]]:
    n = len(items)
    if items[0].mode == UpdateMode.REPLACE:
        if len(matches) < n:
            return None
        if len(matches) > n and not isinstance(items[0].target, PromptIndex):
            target = describe_target(items[0].target, items[0].content.codec)
            raise placeholder_count_error(items[0].modality, n, len(matches), target)
        return [_Edit(start, end, item) for (start, end), item in zip(matches, items)]
    if not matches:
        return None
    if len(matches) >= n:
        return [_Edit(end, end, item) for (_, end), item in zip(matches, items)]
    end = matches[0][1]
    return [_Edit(end, end, item) for item in items]


def _splice(prompt: PromptSeq, edits: list[_Edit]) -> tuple[PromptSeq, list[int]]:
    """Apply edits; returns the new prompt and each edit's offset in it."""
    as_text = isinstance(prompt, str)
    pieces: list = []
    offsets, cursor, length = [], 0, 0
    for edit in edits:
        kept = prompt[cursor : edit.start]
        content = edit.update.content.text if as_text else edit.update.content.token_ids
        pieces += [kept, content]
        offsets.append(length + len(kept))
        length += len(kept) + len(content)
        cursor = edit.end
    pieces.append(prompt[cursor:])
    if as_text:
        return "".join(pieces), offsets
    return [t for piece in pieces for t in piece], offsets


def apply_prompt_updates(
    token_ids: list[int], resolved: ResolvedUpdates, codec: TokenCodec
) -> tuple[list[int], Placeholders]:
    """Apply every item's update to `token_ids`; returns the new ids and the placeholders."""
    if not resolved:
        return list(token_ids), {}
    edits = _plan_edits(token_ids, resolved, codec, strict=False)
    if edits is not None:
        new_ids, offsets = _splice(token_ids, edits)
        return new_ids, _by_modality(edits, offsets)

    # Text fallback: some target only exists inside larger tokens.
    text = codec.decode(token_ids)
    edits = _plan_edits(text, resolved, codec, strict=True)
    new_text, _ = _splice(text, edits)
    new_ids = codec.tokenizer.encode(new_text, add_special_tokens=False)
    offsets, cursor = [], 0
    for edit in edits:
        content = edit.update.content.token_ids
        start = _find(new_ids, content, cursor)
        if start < 0:
            raise ValueError(
                f"The {edit.update.modality} tokens of item {edit.update.item_idx} merged with the text "
                "around them when the prompt was tokenized; put whitespace around the placeholder."
            )
        offsets.append(start)
        cursor = start + len(content)
    return new_ids, _by_modality(edits, offsets)


def _by_modality(edits: list[_Edit], offsets: list[int]) -> Placeholders:
    """Placeholders per modality, listed by item index (edits are sorted by position)."""
    pairs = sorted(zip(edits, offsets), key=lambda p: (p[0].update.modality, p[0].update.item_idx))
    placeholders: Placeholders = {}
    for edit, offset in pairs:
        placeholders.setdefault(edit.update.modality, []).append(edit.update.placeholder(offset))
    return placeholders


def find_applied_placeholders(
    token_ids: list[int], resolved: ResolvedUpdates
) -> dict[str, Union[list[PlaceholderRange], int]]:
    """Where the HF processor already expanded each item, per modality.

    Returns the placeholders when every item is found exactly once, else the number of
    expanded placeholders found (0: the HF processor did not apply this modality's updates).
    """
    result: dict[str, Union[list[PlaceholderRange], int]] = {}
    for modality, candidates in resolved.items():
        best: Union[list[PlaceholderRange], int] = 0
        for items in candidates:
            found, cursor = [], 0
            for item in items:
                start = _find(token_ids, item.content.token_ids, cursor)
                if start < 0:
                    break
                found.append(item.placeholder(start))
                cursor = start + len(item.content.token_ids)
            extra = len(_find_all(token_ids, items[-1].content.token_ids, cursor)) if found else 0
            if len(found) == len(items) and extra == 0:
                best = found
                break
            best = max(best, len(found) + extra) if isinstance(best, int) else best
        result[modality] = best
    return result
