"""A seeded shuffle of range(n) that needs O(1) memory and never changes between versions.

`Permutation(n, seed, epoch)` maps a position p in [0, n) to the sample index shown at that
position. It is a small unbalanced Feistel network on the next power of two above n, with
cycle walking to stay inside [0, n): a bijection for every n, computed one position at a time,
so a dataset of 1e9 samples costs nothing to shuffle and any unit of it costs unit_size calls.

Everything is integer arithmetic on Python ints plus one BLAKE2b digest to derive the round
keys, so the same (n, seed, epoch) gives the same order on every machine, Python and library
version: the server and any worker or replay tool agree on which samples a unit holds. The
order is a good shuffle, not a cryptographic one.
"""

from __future__ import annotations

import hashlib

ROUNDS = 6
MAX_LENGTH = 2**62
_MASK64 = (1 << 64) - 1
_PERSON = b"diloco-perm-v1"  # part of the format: changing it reshuffles every dataset


def round_keys(seed: int, epoch: int) -> tuple[int, ...]:
    """One 64-bit key per Feistel round, from (seed, epoch); every epoch is a derivation."""
    if seed < 0 or epoch < 0:
        raise ValueError(f"seed and epoch must be >= 0, got seed={seed} epoch={epoch}")
    material = f"{seed}:{epoch}".encode()
    digest = hashlib.blake2b(material, digest_size=8 * ROUNDS, person=_PERSON).digest()
    return tuple(int.from_bytes(digest[8 * r : 8 * r + 8], "little") for r in range(ROUNDS))


def _mix(value: int) -> int:
    """SplitMix64's finalizer: every input bit moves about half of the output bits."""
    z = (value + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


class Permutation:
    """A keyed bijection of range(length): position -> sample index."""

    def __init__(self, length: int, seed: int, epoch: int = 0) -> None:
        if isinstance(length, bool) or not isinstance(length, int) or not 1 <= length <= MAX_LENGTH:
            raise ValueError(f"length must be an integer in 1..2**62, got {length!r}")
        self.length = length
        self.seed = seed
        self.epoch = epoch
        self._keys = round_keys(seed, epoch)
        bits = max(1, (length - 1).bit_length())  # the walk stays on [0, 2**bits) ⊇ [0, n)
        self._high_bits = bits // 2
        self._low_bits = bits - bits // 2

    def __call__(self, position: int) -> int:
        if not 0 <= position < self.length:
            raise IndexError(f"position {position} is outside [0, {self.length})")
        if self.length == 1:
            return 0
        value = self._encrypt(position)
        while value >= self.length:  # cycle walking: at most a few steps, 2**bits < 2n
            value = self._encrypt(value)
        return value

    def indices(self, start: int, stop: int) -> list[int]:
        """The sample indices at positions [start, stop): one unit of work."""
        return [self(position) for position in range(start, stop)]

    def _encrypt(self, value: int) -> int:
        """The Feistel network on [0, 2**bits): value = high << low_bits | low, halves swap."""
        high_bits, low_bits = self._high_bits, self._low_bits
        for key in self._keys:
            high = value >> low_bits
            low = value & ((1 << low_bits) - 1)
            value = (low << high_bits) | ((high ^ _mix(low ^ key)) & ((1 << high_bits) - 1))
            high_bits, low_bits = low_bits, high_bits
        return value
