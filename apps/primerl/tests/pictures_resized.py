"""The built-in shapes taskset with every picture scaled to 250 x 250 pixels, a size Qwen-VL's
processor would resize (to 256 x 256): its rollouts cannot train (the trainer does not
reproduce the resize) and must be refused, naming the environment and the task."""

import base64
import io

import verifiers.v1 as vf
from PIL import Image
from primerl_shapes import ShapesTask, ShapesTaskset

__all__ = ["ResizedPicturesTaskset"]


def resized(url: str, size: int = 250) -> str:
    picture = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).resize((size, size))
    buf = io.BytesIO()
    picture.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


class ResizedPicturesTaskset(ShapesTaskset):
    def load(self):
        for task in super().load():
            image, text = task.data.prompt[0].content
            prompt = [
                vf.UserMessage(
                    content=[
                        vf.ImageUrlContentPart(image_url=vf.ImageUrlSource(url=resized(image.image_url.url))),
                        text,
                    ]
                )
            ]
            yield ShapesTask(task.data.model_copy(update={"prompt": prompt}), task.config)
