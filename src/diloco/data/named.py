"""Turn the CLI's --corpus value into corpus bytes."""

from __future__ import annotations

from diloco.data.corpus import load_corpus
from diloco.data.errors import CorpusError
from diloco.data.generated import generated_corpus
from diloco.data.shakespeare import shakespeare_corpus

SHAKESPEARE = "shakespeare"
GENERATED = "generated"


def load_named_corpus(spec: str | None) -> bytes:
    """Resolve a corpus spec: None/"shakespeare", "generated[:SEED]", or a file/folder path.

    A real file or folder named like a keyword would be shadowed; pass it as ./NAME.
    """
    if spec is None or spec == SHAKESPEARE:
        return shakespeare_corpus()
    if spec == GENERATED:
        return generated_corpus()
    if spec.startswith(f"{GENERATED}:"):
        seed_text = spec.partition(":")[2]
        try:
            seed = int(seed_text)
        except ValueError:
            raise CorpusError(
                f"bad corpus spec {spec!r}: the seed after 'generated:' must be an integer"
            ) from None
        return generated_corpus(seed=seed)
    return load_corpus(spec)
