"""Multi-turn episodes on the vLLM backend: the static decoder's episode interface (add(keep=True),
a turn's sample with its "slot", extend, release, parked, decoding, set_version; see
rl/generation/decoding.StaticDecoder and rl/generation/episodes.py) over VllmDecoder.

vLLM keeps nothing between two requests, so a parked slot here is the episode's token history
(prompt, sampled and environment ids). extend() sends the history plus the environment's ids as a
new request; vLLM's prefix cache (enable_prefix_caching, always on in VllmDecoder) serves the
history's full blocks from the previous turn, so mostly the new tokens are computed, as the static
decoder's kept KV cache does. The engine's own count of cached prompt tokens is kept
(`prompt_tokens`, `cached_tokens`), so the saving is measured, not assumed.

Weights never change under a live request: the generator leaves a serving period only when no
slot decodes (every episode waits on its environment), and vLLM loads new weights only then
(VllmDecoder.refresh). So each turn's tokens carry the version its request was sent under, and an
episode spanning a push is trained with each token's own version, as on the static decoder.
"""

from __future__ import annotations

from rl.generation.vllm_engine import VllmDecoder
from rl.generation.vllm_sampling import sampling_params, to_sample

_MIX = 0x9E3779B97F4A7C15   # an odd 64-bit constant: distinct (key, turn start) pairs get distinct seeds


def turn_seed(key: int, noise_start: int) -> int:
    """A turn's sampling seed: the episode's key and the index of the turn's first token in the
    response, so no turn replays another's noise and a re-issued episode samples the same tokens."""
    return (int(key) * _MIX + int(noise_start)) % (2 ** 63)


class VllmEpisodeDecoder(VllmDecoder):
    """VllmDecoder with episodes (module docstring). One caller at a time, as VllmDecoder."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.token_versions = True       # every turn's sample carries them (the generator asks for them)
        self.serving = 0                 # the version set_version() last set: new requests sample under it
        self.histories: dict[int, list[int]] = {}   # busy slot -> its episode's ids so far
        self.owners: dict[int, tuple] = {}          # busy slot -> (tag, key, temperature, keep)
        self.parked: set[int] = set()
        self.prompt_tokens = self.cached_tokens = 0

    # ----- the static decoder's interface ---------------------------------------------------------
    @property
    def active(self) -> int:
        """Busy slots, parked ones included."""
        return len(self.histories)

    @property
    def decoding(self) -> int:
        """Slots with a request in the engine."""
        return len(self.requests)

    def free_slots(self) -> int:
        return self.num_slots - len(self.histories)

    def set_version(self, version: int) -> None:
        self.serving = version

    @property
    def version(self) -> int:
        """The version new requests sample under (StaticDecoder.version)."""
        return self.serving

    def add(self, requests: list[tuple], keep: bool = False) -> None:
        """Requests (prompt_ids, tag, key[, temperature[, max_new_tokens]]) into free slots; keep:
        park the slot when its turn ends (an episode) instead of freeing it."""
        if not requests:
            return
        free = [s for s in range(self.num_slots) if s not in self.histories]
        if len(requests) > len(free):
            raise ValueError(f"VllmEpisodeDecoder.add: {len(requests)} requests, {len(free)} free slots")
        sends = []
        for slot, r in zip(free, requests):
            temperature = r[3] if len(r) > 3 else None
            cap = r[4] if len(r) > 4 else None
            self.histories[slot] = [int(t) for t in r[0]]
            self.owners[slot] = (r[1], int(r[2]), temperature, keep)
            sends.append((slot, 0, cap))
        self._send(sends)

    def extend(self, requests: list[tuple[int, list[int], int, int | None]]) -> None:
        """Resume parked slots: requests (slot, appended ids, noise_start, max_new_tokens or None),
        as StaticDecoder.extend: the next turn samples after the history and the appended ids."""
        if not requests:
            return
        slots = [r[0] for r in requests]
        if any(s not in self.parked for s in slots):
            raise ValueError(f"VllmEpisodeDecoder.extend: slots {slots} are not all parked ({sorted(self.parked)})")
        for slot, ids, _, _ in requests:
            self.parked.discard(slot)
            self.histories[slot] += [int(t) for t in ids]
        self._send([(slot, noise_start, cap) for slot, _, noise_start, cap in requests])

    def release(self, slot: int) -> None:
        """Free a parked slot (its episode ended)."""
        self.parked.discard(slot)
        self.histories.pop(slot, None)
        self.owners.pop(slot, None)

    def step(self, num_steps: int = 8) -> list[tuple[object, dict]]:
        """Up to `num_steps` engine steps, returning early once a turn ended: [(tag, sample)]; a
        kept slot's sample has "slot" and the slot is parked (its history kept) for extend()."""
        out = []
        with self._lock:
            for _ in range(num_steps):
                if not self.requests:
                    break
                for ro in self.engine.step():
                    if ro.finished:
                        out.append(self._turn_ended(ro))
                if out:
                    break
            if not self.histories:    # sleep only when no episode waits to go on
                self._arm_sleep()
        return out

    def abort(self) -> None:
        """Drop every request in flight and every parked episode (their samples are lost)."""
        super().abort()
        self.histories.clear()
        self.owners.clear()
        self.parked.clear()

    # ----- inside ---------------------------------------------------------------------------------
    def _send(self, sends: list[tuple[int, int, int | None]]) -> None:
        """(slot, noise_start, max_new_tokens or None): each slot's history as one engine request."""
        with self._lock:
            self._ready()
            for slot, noise_start, cap in sends:
                tag, key, temperature, _ = self.owners[slot]
                ids = self.histories[slot]
                cap = self._cap(cap)
                if len(ids) + cap > self.max_len:
                    raise ValueError(f"VllmEpisodeDecoder: slot {slot} holds {len(ids)} tokens; {cap} new ones "
                                     f"exceed the engine's max_model_len={self.max_len}")
                params = sampling_params(
                    temperature=self.temperature if temperature is None else temperature,
                    seed=turn_seed(key, noise_start) if self.config.seeded else None,
                    **{**self._params, "max_new_tokens": cap})
                rid = str(self._count)
                self._count += 1
                self.requests[rid] = (slot, list(ids), self.serving)
                self.engine.add_request(rid, {"prompt_token_ids": list(ids)}, params)

    def _turn_ended(self, ro) -> tuple[object, dict]:
        slot, prompt, version = self.requests.pop(ro.request_id)
        sample = to_sample(prompt, ro.outputs[0], self.stop_ids)
        sample["token_versions"] = [version] * len(sample["response_ids"])
        cached = getattr(ro, "num_cached_tokens", None)
        self.prompt_tokens += len(prompt)
        self.cached_tokens += int(cached or 0)
        tag, _, _, keep = self.owners[slot]
        if keep:
            sample["slot"] = slot
            self.histories[slot] += sample["response_ids"]
            self.parked.add(slot)
        else:
            self.release(slot)
        return tag, sample
