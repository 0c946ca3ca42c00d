"""shapes: questions about a picture of coloured shapes, drawn in code (a vision-language task).

Each task is one PNG (a data URL in the user message, before the question) of 2-`max_shapes`
circles, squares and triangles in a few colours on white, none touching another, and one
question of two kinds:

- count: "How many red shapes are there?" -> "2"
- largest: "What colour is the largest shape?" -> "blue" (the largest is at least 1.5x the area
  of every other, so the answer is never a close call)

Reward 1.0 when the reply, trimmed of spaces, a final full stop and case, is the answer, else
0.0. Images are `size` pixels square, a multiple of 32 and at least 256 by default, so that
Qwen-VL processors (patches of 16, merged 2 x 2, at least 256 x 256 pixels) take them as they
are: what the trainer recomputes from the PNG is exactly what the server saw, with no resize in
between. Data is generated from `seed`.
"""

from __future__ import annotations

import base64
import io
import math
import random

import verifiers.v1 as vf
from primerl_envs.tasks import AnswerData

__all__ = ["ShapesTaskset"]

COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (230, 200, 30)}
KINDS = ("circle", "square", "triangle")


class ShapesTask(vf.Task[AnswerData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def exact(self, trace: vf.Trace) -> float:
        return 1.0 if normalise(trace.last_reply or "") == self.data.answer else 0.0


def normalise(reply: str) -> str:
    return reply.strip().rstrip(".").strip().lower()


class ShapesConfig(vf.TasksetConfig):
    num_tasks: int = 1000
    """How many pictures (one question each) to generate."""
    size: int = 256
    """Width and height of each picture in pixels (a multiple of 32: see the module's docstring)."""
    max_shapes: int = 5
    """Most shapes in a picture (at least 2)."""
    questions: list[str] = ["count", "largest"]
    """The kinds of question asked, taken in turn."""
    seed: int = 0
    """Seed of the generated data."""


def draw(shapes: list[tuple[str, str, int, int, int]], size: int) -> bytes:
    """PNG bytes of `shapes` (kind, colour, centre x, centre y, radius) on white."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (size, size), (255, 255, 255))
    pen = ImageDraw.Draw(image)
    for kind, colour, x, y, r in shapes:
        fill = COLOURS[colour]
        if kind == "circle":
            pen.ellipse([x - r, y - r, x + r, y + r], fill=fill)
        elif kind == "square":
            pen.rectangle([x - r, y - r, x + r, y + r], fill=fill)
        else:
            pen.polygon([(x, y - r), (x - r, y + r), (x + r, y + r)], fill=fill)
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def area(kind: str, r: int) -> float:
    return {"circle": math.pi * r * r, "square": 4.0 * r * r, "triangle": 2.0 * r * r}[kind]


def layout(rng: random.Random, size: int, count: int) -> list[tuple[str, str, int, int, int]]:
    """`count` shapes whose bounding squares keep a gap of 4 pixels (so none touches another);
    ValueError when 10,000 tries place fewer (a picture too small for them)."""
    shapes: list[tuple[str, str, int, int, int]] = []
    for _ in range(10_000):
        if len(shapes) == count:
            return shapes
        r = rng.randint(max(6, size // 40), max(8, size // 9))
        x, y = rng.randint(r + 2, size - r - 3), rng.randint(r + 2, size - r - 3)
        if all(abs(x - sx) > r + sr + 4 or abs(y - sy) > r + sr + 4 for _, _, sx, sy, sr in shapes):
            shapes.append((rng.choice(KINDS), rng.choice(list(COLOURS)), x, y, r))
    raise ValueError(
        f"shapes: could not place {count} shapes apart in a picture of {size} x {size} pixels: "
        "lower max_shapes or raise size"
    )


class ShapesTaskset(vf.Taskset[ShapesTask, ShapesConfig]):
    def load(self):
        cfg = self.config
        if cfg.size % 32 or cfg.max_shapes < 2 or not set(cfg.questions) <= {"count", "largest"} or not cfg.questions:
            raise ValueError(
                f"shapes: size must be a multiple of 32 (got {cfg.size}), max_shapes at least 2 "
                f"(got {cfg.max_shapes}), questions among count and largest (got {cfg.questions})"
            )
        rng = random.Random(cfg.seed)
        made = 0
        while made < cfg.num_tasks:
            question = cfg.questions[made % len(cfg.questions)]
            shapes = layout(rng, cfg.size, rng.randint(2, cfg.max_shapes))
            if question == "count":
                colour = rng.choice([c for _, c, *_ in shapes] + list(COLOURS))  # sometimes none of it
                text, answer = f"How many {colour} shapes are there?", str(sum(c == colour for _, c, *_ in shapes))
            else:
                areas = sorted(((area(k, r), c) for k, c, _, _, r in shapes), reverse=True)
                if areas[0][0] < 1.5 * areas[1][0]:
                    continue  # no clear largest: draw another picture
                text, answer = "What colour is the largest shape?", areas[0][1]
            url = "data:image/png;base64," + base64.b64encode(draw(shapes, cfg.size)).decode()
            prompt = [
                vf.UserMessage(
                    content=[
                        vf.ImageUrlContentPart(image_url=vf.ImageUrlSource(url=url)),
                        vf.TextContentPart(text=text),
                    ]
                )
            ]
            data = AnswerData(id=f"shapes-{made}", prompt=prompt, answer=answer)  # pyright: ignore[reportCallIssue] (verifiers' Field(default, ...) positional defaults read as required)
            yield ShapesTask(data, cfg.task)
            made += 1
