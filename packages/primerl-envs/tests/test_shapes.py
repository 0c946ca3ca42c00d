"""The shapes environment (a picture and a question): each answer recomputed from the PNG's
pixels alone (shapes counted as connected regions of one colour, the largest by its pixels), so
the generator's own bookkeeping is not what is checked."""

import asyncio
import base64
import io
from collections import Counter
from types import SimpleNamespace

import pytest
from PIL import Image
from primerl_envs.config import EnvConfig
from primerl_envs.environment import Environment, EnvLoadError
from primerl_shapes import COLOURS


def regions(image: Image.Image) -> list[tuple[str, int]]:
    """(colour name, pixels) of each 4-connected region of one of COLOURS."""
    w, h = image.size
    px = image.load()
    names = {rgb: name for name, rgb in COLOURS.items()}
    seen, out = set(), []
    for y in range(h):
        for x in range(w):
            if (x, y) in seen or px[x, y] not in names:
                continue
            colour, stack, n = px[x, y], [(x, y)], 0
            seen.add((x, y))
            while stack:
                cx, cy = stack.pop()
                n += 1
                for nx, ny in ((cx + 1, cy), (cx - 1, cy), (cx, cy + 1), (cx, cy - 1)):
                    if 0 <= nx < w and 0 <= ny < h and (nx, ny) not in seen and px[nx, ny] == colour:
                        seen.add((nx, ny))
                        stack.append((nx, ny))
            out.append((names[colour], n))
    return out


def test_each_answer_is_what_the_pictures_pixels_say():
    env = Environment(EnvConfig(id="shapes", args={"num_tasks": 24, "size": 128, "max_shapes": 6}))
    kinds = Counter()
    for _ in range(24):
        task = env.tasks.next()
        [message] = task.data.prompt
        image_part, text_part = message.content
        url = image_part.image_url.url
        assert message.role == "user" and url.startswith("data:image/png;base64,")
        image = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))
        assert image.size == (128, 128) and image.mode == "RGB"
        found = regions(image)
        assert 2 <= len(found) <= 6
        question = text_part.text
        if question.startswith("How many"):
            colour = question.split()[2]
            assert task.data.answer == str(sum(c == colour for c, _ in found)), (question, found)
            kinds["count"] += 1
        else:
            assert question == "What colour is the largest shape?"
            assert task.data.answer == max(found, key=lambda r: r[1])[0], found
            kinds["largest"] += 1
    assert kinds["count"] == kinds["largest"] == 12


def test_the_reward_is_the_exact_answer_whatever_the_case_spaces_or_full_stop():
    env = Environment(EnvConfig(id="shapes", args={"num_tasks": 2, "questions": ["largest"]}))
    task = env.tasks.next()
    answer = task.data.answer

    def reward(reply):
        return asyncio.run(task.exact(SimpleNamespace(last_reply=reply)))  # the trace stood in: its reply

    assert reward(answer) == reward(f" {answer.upper()}. ") == 1.0
    assert reward("purple") == reward("") == reward(None) == reward(f"{answer} shape") == 0.0


@pytest.mark.parametrize(
    "args, message",
    [
        ({"size": 100}, "multiple of 32"),
        ({"max_shapes": 1}, "max_shapes"),
        ({"questions": ["colour"]}, "questions"),
        ({"size": 32, "max_shapes": 40}, "could not place"),  # before: an endless loop
    ],
)
def test_bad_settings_are_refused_naming_them(args, message):
    with pytest.raises((EnvLoadError, ValueError), match=message):
        Environment(EnvConfig(id="shapes", args={"num_tasks": 2, **args})).tasks.next()
