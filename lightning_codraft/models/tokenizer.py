"""The character tokenizer of the tiny built-in policy (its vocabulary is part of the model's shape, so it lives with
the models: ``models.presets.recipe_architecture`` builds the tiny policy over it), and :func:`encode_prompt`, how a
prompt text becomes ids with any tokenizer (a chat template where the tokenizer has one)."""

from __future__ import annotations

from collections.abc import Sequence


class CharTokenizer:
    """A character tokenizer for the tiny built-in policy (the project's tokenizer protocol).

    Ids 0, 1, 2 are ``<pad>``, ``<bos>``, ``<eos>``; then one id per character of ``alphabet``.
    ``encode`` adds no special tokens; it raises on a character outside the alphabet.
    """

    DEFAULT_ALPHABET = "0123456789+-*=,#?:. \nabcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"

    def __init__(self, alphabet: str = DEFAULT_ALPHABET):
        if len(set(alphabet)) != len(alphabet):
            raise ValueError(f"alphabet has repeated characters: {alphabet!r}")
        self.alphabet = alphabet
        self.pad_token_id = 0
        self.bos_token_id = 1
        self.eos_token_id = 2
        self._to_id = {c: i + 3 for i, c in enumerate(alphabet)}

    @property
    def vocab_size(self) -> int:
        return len(self.alphabet) + 3

    def encode(self, text: str) -> list[int]:
        try:
            return [self._to_id[c] for c in text]
        except KeyError as e:
            raise ValueError(
                f"character {e.args[0]!r} in {text!r} is not in the tokenizer alphabet {self.alphabet!r}"
            ) from None

    def to_transformers(self):
        """This tokenizer as a ``transformers`` ``PreTrainedTokenizerFast`` with the same ids (one per character,
        pad / bos / eos at 0 / 1 / 2): its ``save_pretrained`` directory loads with ``AutoTokenizer``."""
        from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers  # heavy optional: on export only
        from transformers import PreTrainedTokenizerFast

        vocab = {"<pad>": self.pad_token_id, "<bos>": self.bos_token_id, "<eos>": self.eos_token_id, **self._to_id}
        tok = Tokenizer(models.WordLevel(vocab, unk_token=None))
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every character alone
        tok.decoder = decoders.Fuse()  # characters join without separators
        return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>")

    def decode(self, ids: Sequence[int]) -> str:
        out = []
        for i in ids:
            i = int(i)
            if i == self.eos_token_id:
                break
            if i >= 3:
                out.append(self.alphabet[i - 3])
        return "".join(out)


def encode_prompt(tokenizer, prompt) -> list[int]:
    """Prompt ids of a text (the tokenizer's ``encode_prompt``, its chat template, when it has one, else ``encode``)
    or of a conversation in TRL's form, a list of ``{"role", "content"}`` messages (the tokenizer's
    ``encode_messages``: its chat template, generation prompt appended).

    Raises:
        ValueError: a conversation and a tokenizer without a chat template.
    """
    if isinstance(prompt, (list, tuple)):
        encode = getattr(tokenizer, "encode_messages", None)
        if encode is None:
            raise ValueError(
                f"the prompt is a list of chat messages but the tokenizer ({type(tokenizer).__name__}) "
                f"has no chat template to render it; use a text prompt column or a chat model"
            )
        return list(encode(list(prompt)))
    return list(getattr(tokenizer, "encode_prompt", tokenizer.encode)(prompt))
