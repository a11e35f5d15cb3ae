"""python -m client [--url HOST:PORT] [--protocol http|grpc] COMMAND ...: the bundle's models from a shell.

Talks to a running tritonserver (`make serve`). Without --url it uses localhost:$HTTP_PORT (default 8000) for http and
localhost:$GRPC_PORT (default 8001) for grpc, the ports `make serve` listens on. The protocol is http, except for
generate, which defaults to grpc. Failures print one `error: ...` line and exit with status 1.
"""
from __future__ import annotations

import argparse
import json
import socket
import sys
from pathlib import Path
from typing import Iterator

import numpy as np
from tritonclient.utils import InferenceServerException

from client.sdk import Client, default_url


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    protocol = args.protocol or ("grpc" if args.command == "generate" else "http")
    url = args.url or default_url(protocol)
    try:
        with Client(url, protocol) as client:
            run(parser, args, client)
    except KeyboardInterrupt:
        return 130
    except Exception as error:  # a CLI user wants the reason, not a traceback
        print(f"error: {describe(error, url, protocol)}", file=sys.stderr)
        return 1
    return 0


def describe(error: Exception, url: str, protocol: str) -> str:
    """One line saying what went wrong; a refused connection also says where the CLI looked and how to point it."""
    if _is_unreachable(error):
        variable = "HTTP_PORT" if protocol == "http" else "GRPC_PORT"
        return (f"the server at {url} ({protocol}) is not reachable; is tritonserver running (`make serve`)? "
                f"Set {variable} or pass --url HOST:PORT")
    if isinstance(error, InferenceServerException):
        text = error.message() or str(error)
    elif isinstance(error, OSError) and error.strerror and error.filename:
        text = f"{error.strerror}: {error.filename}"
    else:
        text = str(error) or type(error).__name__
    return " ".join(text.split())


def _is_unreachable(error: Exception) -> bool:
    """Nothing listens at the URL (or its host is unknown): HTTP raises the socket's error, gRPC an UNAVAILABLE
    "failed to connect" / "DNS resolution failed" InferenceServerException."""
    if isinstance(error, (ConnectionRefusedError, socket.gaierror)):
        return True
    if isinstance(error, InferenceServerException):
        message = (error.message() or "").lower()
        return "failed to connect" in message or "dns resolution failed" in message
    return False


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m client", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--protocol", choices=["http", "grpc"],
                        help="default: grpc for generate, http for the other commands")
    parser.add_argument("--url", metavar="HOST:PORT", help="tritonserver to call (default localhost:$HTTP_PORT, 8000, "
                                                           "for http; localhost:$GRPC_PORT, 8001, for grpc)")
    sub = parser.add_subparsers(dest="command", required=True)
    classify = sub.add_parser("classify", help="top-k labels from vit")
    classify.add_argument("images", nargs="+", type=Path)
    classify.add_argument("--top-k", type=int, default=5)
    embed = sub.add_parser("embed", help="CLIP embeddings of images and/or texts")
    embed.add_argument("--image", action="append", type=Path, default=[])
    embed.add_argument("--text", action="append", default=[])
    similarity = sub.add_parser("similarity", help="score one image against texts with the clip pipeline")
    similarity.add_argument("image", type=Path)
    similarity.add_argument("texts", nargs="+")
    generate = sub.add_parser("generate", help="text from the llm model, or vlm with --image")
    generate.add_argument("prompt")
    generate.add_argument("--image", type=Path, help="ask the vlm model about this image (over grpc, the default)")
    generate.add_argument("--model", help="another generating model (default: llm, or vlm with --image)")
    generate.add_argument("--max-tokens", type=int, default=64)
    generate.add_argument("--stream", action="store_true", help="print tokens as they arrive")
    generate.add_argument("--temperature", type=float)
    generate.add_argument("--top-p", type=float)
    generate.add_argument("--top-k", type=int)
    generate.add_argument("--seed", type=int)
    generate.add_argument("--stop", action="append", help="a stop string (repeatable)")
    generate.add_argument("--lora", help="a LoRA adapter of the model (its folder name in the adapter root, or auto)")
    generate.add_argument("--qos-class", choices=["high", "normal", "low"], help="the request's QoS class")
    adapters = sub.add_parser("adapters", help="list, load or unload a generating model's LoRA adapters")
    adapters.add_argument("action", choices=["list", "load", "unload"])
    adapters.add_argument("name", nargs="?", default="", help="the adapter (load, unload)")
    adapters.add_argument("--model", default="llm")
    tile = sub.add_parser("tile", help="LLaVA-NeXT tiles and visual token count of an image from anyres")
    tile.add_argument("image", type=Path)
    transcribe = sub.add_parser("transcribe", help="speech to text with the whisper model")
    transcribe.add_argument("audio", type=Path, help="WAV, FLAC, OGG, ... file")
    transcribe.add_argument("--language", help="language code, e.g. en (default: detected)")
    transcribe.add_argument("--task", choices=["transcribe", "translate"], default="transcribe")
    transcribe.add_argument("--max-tokens", type=int)
    segment = sub.add_parser("segment", help="mask for a click or box with the sam model, as a PNG overlay")
    segment.add_argument("image", type=Path)
    segment.add_argument("--point", action="append", default=[], help="x,y on the object (repeatable)")
    segment.add_argument("--background", action="append", default=[], help="x,y not on the object (repeatable)")
    segment.add_argument("--box", help="x0,y0,x1,y1 around the object")
    segment.add_argument("--out", type=Path, help="overlay PNG (default: IMAGE.mask.png)")
    return parser


def run(parser: argparse.ArgumentParser, args: argparse.Namespace, client: Client) -> None:
    np.set_printoptions(precision=4, suppress=True)
    if args.command == "classify":
        for path, labels in zip(args.images, client.classify([p.read_bytes() for p in args.images], args.top_k)):
            print(f"{path}: " + ", ".join(f"{x.label} {x.score:.3f}" for x in labels))
    elif args.command == "embed":
        if not args.image and not args.text:
            parser.error("embed needs --image and/or --text")
        if args.image:
            for path, vector in zip(args.image, client.embed_images([p.read_bytes() for p in args.image])):
                print(f"{path}: dim {vector.size}, {vector[:6]} ...")
        if args.text:
            for text, vector in zip(args.text, client.embed_texts(args.text)):
                print(f"{text!r}: dim {vector.size}, {vector[:6]} ...")
    elif args.command == "generate":
        optional = {k: v for k, v in (("temperature", args.temperature), ("top_p", args.top_p), ("top_k", args.top_k),
                                      ("seed", args.seed), ("stop", args.stop), ("lora_id", args.lora),
                                      ("qos_class", args.qos_class)) if v is not None}
        image = args.image.read_bytes() if args.image else None
        _print_stream(client.generate(args.prompt, args.max_tokens, stream=args.stream, model=args.model,
                                      image=image, **optional))
    elif args.command == "adapters":
        if args.action != "list" and not args.name:
            parser.error(f"adapters {args.action} needs the adapter's name")
        print(json.dumps(client.adapters(args.action, args.name, args.model), indent=2))
    elif args.command == "tile":
        pixels, tokens = client.tile(args.image.read_bytes())
        print(f"{args.image}: {pixels.shape[0]} tiles of {pixels.shape[-1]}x{pixels.shape[-2]} pixels, "
              f"{tokens} visual tokens")
    elif args.command == "segment":
        points = [_floats(p, 2) for p in args.point + args.background]
        labels = [1] * len(args.point) + [0] * len(args.background)
        if not points and not args.box:
            parser.error("segment needs --point, --background or --box")
        data = args.image.read_bytes()
        masks, scores, _ = client.segment(data, points, labels, _floats(args.box, 4) if args.box else None)
        best = int(np.argmax(scores))
        out = args.out or args.image.with_suffix(".mask.png")
        overlay(data, masks[best]).save(out)
        print(f"{out}: mask {best} of {len(scores)} (IoU score {scores[best]:.3f}), "
              f"{int(masks[best].sum())} pixels")
    elif args.command == "transcribe":
        text, _ = client.transcribe(args.audio.read_bytes(), args.language, args.task, args.max_tokens)
        print(_terminal_safe(text))
    else:
        scores, probs = client.similarity(args.image.read_bytes(), args.texts)
        for text, score, prob in zip(args.texts, scores, probs):
            print(f"{prob:6.3f}  (logit {score:7.3f})  {text}")


def _print_stream(deltas: Iterator[str]) -> None:
    """Deltas as they arrive; a stream failing midway still ends its line, so the error line starts clean."""
    started = False
    try:
        for delta in deltas:
            started = True
            print(_terminal_safe(delta), end="", flush=True)
    except BaseException:
        if started:
            print(flush=True)
        raise
    print()


def _floats(text: str, count: int) -> tuple[float, ...]:
    values = tuple(float(v) for v in text.split(","))
    if len(values) != count:
        raise ValueError(f"expected {count} comma-separated numbers, got {text!r}")
    return values


def overlay(image: bytes, mask: np.ndarray, color=(255, 40, 120), alpha: float = 0.5):
    """The image with the mask tinted in (EXIF orientation applied, as the server saw it)."""
    import io

    from PIL import Image, ImageOps

    base = np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(image))).convert("RGB"), dtype=np.float32)
    base[mask] = (1 - alpha) * base[mask] + alpha * np.array(color, dtype=np.float32)
    return Image.fromarray(base.astype(np.uint8))


def _terminal_safe(text: str) -> str:
    """Control characters (a model can emit any byte) shown escaped instead of acting on the terminal."""
    return "".join(c if c.isprintable() or c in "\n\t" else repr(c)[1:-1] for c in text)


if __name__ == "__main__":
    sys.exit(main())
