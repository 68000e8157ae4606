# A filmstrip: frames of a video side by side in one PNG, to see a movement at a glance (a flip's take-off, turn and
# landing) where a page shows no video; optionally the same stretch as a GIF.
#
#   python framework/evaluation.py --policy policies/hopper-landed-backflip-sac.pt --episodes 1 --video --video-dir videos/flip
#   python toolbox/filmstrip.py videos/flip/episode_0.mp4 --first 100 --last 160 --frames 8 --output flip.png --gif flip.gif
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import numpy as np
import tyro

from cleanrlhf_utils.arguments import parse_args
from cleanrlhf_utils.envs import write_gif
from cleanrlhf_utils.errors import ConfigError, need


@dataclass
class Args:
    video: Annotated[str, tyro.conf.Positional]
    """an mp4 (evaluation.py --video writes one per episode)"""
    output: str
    """the PNG to write"""
    first: int = 0
    """the first frame of the stretch (0-based; evaluation videos have one frame per env step)"""
    last: int | None = None
    """its last frame (default: the video's last)"""
    frames: int = 8
    """frames in the strip, evenly spaced from --first to --last"""
    crop: tuple[int, int] | None = None
    """keep only columns FROM TO of each frame (pixels), where the movement happens"""
    gif: str | None = None
    """also write the stretch, every frame of it, as a GIF"""
    gif_step: int = 1
    """with --gif, keep every n-th frame (a smaller file), each shown n times as long"""
    gif_scale: float = 1.0
    """with --gif, scale its frames by this factor (0.5: half the width and height, about a quarter of the file)"""


def read_frames(path: str | Path) -> tuple[np.ndarray, float]:
    """All frames of a video [T, H, W, 3] and its frames per second."""
    import imageio_ffmpeg

    reader = imageio_ffmpeg.read_frames(str(path))
    meta = next(reader)
    width, height = meta["size"]
    frames = np.stack([np.frombuffer(frame, dtype=np.uint8).reshape(height, width, 3) for frame in reader])
    return frames, float(meta["fps"])


def strip(frames: np.ndarray, separator: int = 2) -> np.ndarray:
    """Frames [N, H, W, 3] side by side, `separator` white columns between them: one image [H, N * W + ..., 3]."""
    count, height, _, channels = frames.shape
    gap = np.full((count, height, separator, channels), 255, dtype=frames.dtype)
    return np.concatenate(np.concatenate([frames, gap], axis=2), axis=1)[:, :-separator]


def main(args: Args) -> None:
    frames, fps = read_frames(args.video)
    last = len(frames) - 1 if args.last is None else args.last
    need(0 <= args.first <= last < len(frames), f"--first {args.first} --last {last}: the video has frames 0 to {len(frames) - 1}")
    need(args.frames >= 1 and args.gif_step >= 1, "--frames and --gif-step must be >= 1")
    stretch = frames[args.first : last + 1]
    if args.crop is not None:
        need(
            0 <= args.crop[0] < args.crop[1] <= frames.shape[2], f"--crop {args.crop[0]} {args.crop[1]}: frames are {frames.shape[2]} wide"
        )
        stretch = stretch[:, :, args.crop[0] : args.crop[1]]
    from PIL import Image

    picked = np.linspace(0, len(stretch) - 1, args.frames).round().astype(int)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(strip(stretch[picked])).save(args.output, optimize=True)
    print(f"{args.output}: frames {', '.join(str(args.first + index) for index in picked)}")
    if args.gif:
        need(0 < args.gif_scale <= 1, f"--gif-scale {args.gif_scale}: between 0 (excluded) and 1")
        size = (round(stretch.shape[2] * args.gif_scale), round(stretch.shape[1] * args.gif_scale))
        kept = stretch[:: args.gif_step]
        write_gif(args.gif, kept, 1000 * args.gif_step / fps, size)
        print(f"{args.gif}: {len(kept)} frames, {Path(args.gif).stat().st_size // 1024} kB")


if __name__ == "__main__":
    try:
        main(parse_args(Args))
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
