"""A small, real byte-level BPE tokenizer for synthetic models, built offline and deterministically.

The BPE merges are trained when called, on the English text embedded below, so a synthetic model
gets a tokenizer that round-trips any text (byte-level: every byte is in the vocabulary) and
that has a chat template, without any download. Special tokens sit at the ids the tiny configs
use (packtools.arch.tiny): pad 0, bos 1, eos 2, then <|im_start|> and <|im_end|>.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from packtools.arch.tiny import BOS_TOKEN_ID, EOS_TOKEN_ID, PAD_TOKEN_ID

PAD, BOS, EOS, IM_START, IM_END = "<|pad|>", "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (PAD, BOS, EOS, IM_START, IM_END)  # ids 0..4, in this order
assert SPECIAL_TOKENS.index(PAD) == PAD_TOKEN_ID
assert SPECIAL_TOKENS.index(BOS) == BOS_TOKEN_ID
assert SPECIAL_TOKENS.index(EOS) == EOS_TOKEN_ID
BYTE_ALPHABET = 256
MIN_VOCAB = BYTE_ALPHABET + len(SPECIAL_TOKENS)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Training text: plain English about computers, storage and the weather, written for this module.
CORPUS = """\
A computer keeps its working data in memory and its long term data on a disk. Memory is fast
but small; the disk is large but slow. Good programs move data between the two with care, and
they read from the disk in large blocks, because every request has a fixed cost before the
first byte arrives. When a program needs a piece of data again and again, it keeps a copy
close at hand. That copy is called a cache. A cache is useful only when the same data is asked
for more than once, and it must decide what to throw away when it is full.

The weather this morning was cold and clear. By noon the wind came from the west and the sky
turned grey. People walked quickly along the river, holding their coats closed against the
wind. In the evening it began to rain, first softly and then with a steady sound on the roofs.
The children watched the water run down the windows and waited for the storm to pass.

A language model reads a sequence of tokens and predicts the next one. Each token is a small
piece of text: a word, a part of a word, or a single character. The model turns each token into
a vector of numbers, passes the vectors through many layers, and at the end produces a score
for every token in its vocabulary. The token with the highest score is the most likely next
token. Repeating this step one token at a time produces a sentence, then a paragraph.

Some models are very large. To keep them fast, a mixture of experts model splits each layer
into many small networks called experts, and a router chooses only a few experts for each
token. Most of the experts are not used for any given token, so they do not need to sit in the
fastest memory all the time. They can wait on a disk and be brought in when the router asks for
them, as long as the system can find and load them quickly.

The old library on the hill has thousands of books. Some are new and bright; others are old,
with soft paper and faded letters. The librarian knows where each book belongs, and she can
find any of them in a minute. Visitors come to read, to write letters, and to sit quietly by
the tall windows. On Saturdays there is a story hour for children, and the room fills with
laughter and questions.

To measure a system, first decide what matters: the time to answer one request, the number of
requests answered in a second, or the cost of the machines. Then measure under the same
conditions every time, write down every number, and compare results only when nothing else has
changed. A careful measurement is worth more than a fast guess, and a simple table of numbers
often tells the whole story.

The market opens early. Farmers bring apples, pears, bread, cheese, eggs and flowers. A man
sells honey from his own bees, and a woman plays the violin near the fountain. By ten o'clock
the square is full of people who talk, buy, taste and laugh. When the church bell rings at one,
the stalls close, and the square is quiet again until the next week.

Numbers can be written in many ways: 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 100, 1000, 4096, 65536.
Questions end with a question mark? Lists use commas, and some sentences use a colon: like this
one. Quotes look like "this", and code looks like print(x + y) or value = table[key].
"""


def build_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with exactly `vocab_size` entries (>= 261).

    Merges are learned from CORPUS; when the corpus yields fewer merges than the vocabulary
    has room for, the remaining ids are filled with reserved special tokens so that the
    tokenizer's size equals the model's vocabulary.
    """
    if vocab_size < MIN_VOCAB:
        raise ValueError(f"vocab_size {vocab_size} < {MIN_VOCAB} (256 bytes + {len(SPECIAL_TOKENS)} special tokens)")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    reserved = [f"<|reserved_{i}|>" for i in range(vocab_size - tokenizer.get_vocab_size())]
    if reserved:
        tokenizer.add_special_tokens(reserved)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, BOS_TOKEN_ID)]
    )
    assert tokenizer.get_vocab_size() == vocab_size
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[IM_START, IM_END],
        model_max_length=4096,
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def write_tokenizer(out_dir: Path | str, vocab_size: int) -> list[str]:
    """Build the tokenizer and save it into out_dir; returns the file names written."""
    out_dir = Path(out_dir)
    before = set(p.name for p in out_dir.iterdir()) if out_dir.is_dir() else set()
    build_tokenizer(vocab_size).save_pretrained(out_dir)
    return sorted(set(p.name for p in out_dir.iterdir()) - before)
