"""Decoding videos (tessera.multimodal.video), loading them from URLs (media.load_video_url), and
parsing "video" data (parse.py), against a video drawn frame by frame (testkit.video_frame):
the top half's colour cycles through VIDEO_COLORS, a white square moves SQUARE_STEP pixels a frame."""

from __future__ import annotations

import base64
import io
import math

import numpy as np
import pytest
from PIL import Image

from tessera.errors import InputError, InputTooLargeError
from tessera.multimodal.hasher import MultiModalHasher
from tessera.multimodal.media import LOCAL_FILES, MediaPolicy, load_video_url
from tessera.multimodal.parse import MultiModalDataParser, VideoProcessorItems
from tessera.multimodal.video import VideoFrames, decode_video
from testkit import VIDEO_COLORS, png_bytes, video_bytes, video_frame
from testkit.video import SQUARE_SIDE, SQUARE_STEP

FRAMES, WIDTH, HEIGHT, FPS = 16, 64, 48, 8


@pytest.fixture(scope="module")
def mp4():
    return video_bytes(FRAMES, WIDTH, HEIGHT, FPS)


def top_colour(frame):
    """The colour drawn in the top half, read back: each channel is either on (255) or off (0)."""
    mean = frame[4 : HEIGHT // 2 - 4, 4:-4].reshape(-1, 3).mean(axis=0)
    return tuple(255 if c > 127 else 0 for c in mean)


def square_left(frame):
    """The left edge of the white square in the bottom half, from its bright columns' centroid."""
    bottom = frame[HEIGHT // 2 :].min(axis=2).astype(float)  # white: all channels high
    columns = (bottom > 127).sum(axis=0)
    return float((columns * np.arange(WIDTH)).sum() / columns.sum()) - (SQUARE_SIDE - 1) / 2


def frame_index(frame):
    return round(square_left(frame) / SQUARE_STEP)


def linspace_floor(total, n):
    """np.linspace(0, total - 1, n, dtype=int), written out: k * (total - 1) / (n - 1) rounded down."""
    return [0] if n == 1 else [math.floor(k * (total - 1) / (n - 1)) for k in range(n)]


# ---- decoding ----------------------------------------------------------------------------------


def test_every_frame_decodes_with_its_size_rate_and_metadata(mp4):
    video = decode_video(mp4, num_frames=-1)
    assert video.frames.shape == (FRAMES, HEIGHT, WIDTH, 3) and video.frames.dtype == np.uint8
    assert (video.fps, video.duration, video.total_num_frames) == (FPS, FRAMES / FPS, FRAMES)
    assert video.frames_indices == tuple(range(FRAMES))
    assert video.timestamps == [i / FPS for i in range(FRAMES)]
    assert video.metadata == {"total_num_frames": FRAMES, "fps": FPS, "width": WIDTH, "height": HEIGHT,
                              "duration": FRAMES / FPS, "video_backend": "pyav",
                              "frames_indices": list(range(FRAMES))}  # fmt: skip


def test_the_metadata_is_what_transformers_takes(mp4):
    from transformers.video_utils import VideoMetadata

    video = decode_video(mp4, num_frames=4)
    assert VideoMetadata(**video.metadata).timestamps == video.timestamps


def test_decoded_frames_show_what_was_drawn(mp4):
    video = decode_video(mp4, num_frames=-1)
    for i, frame in enumerate(video.frames):
        assert top_colour(frame) == VIDEO_COLORS[i % len(VIDEO_COLORS)], i
        assert abs(square_left(frame) - i * SQUARE_STEP) < 1, i
        # and close to the drawn pixels overall (mpeg4 is lossy)
        assert np.abs(frame.astype(int) - video_frame(i, WIDTH, HEIGHT).astype(int)).mean() < 4


@pytest.mark.parametrize("codec, container", [("libx264", "mp4"), ("mpeg4", "avi"), ("libx264", "matroska")])
def test_other_codecs_and_containers_decode(codec, container):
    video = decode_video(video_bytes(8, WIDTH, HEIGHT, FPS, codec=codec, container=container), num_frames=-1)
    assert video.frames.shape == (8, HEIGHT, WIDTH, 3) and video.fps == FPS
    assert [frame_index(f) for f in video.frames] == list(range(8))


# ---- sampling ----------------------------------------------------------------------------------


@pytest.mark.parametrize("num_frames", [1, 2, 5, 15, 16, 100])
def test_num_frames_picks_evenly_spaced_frames(mp4, num_frames):
    expected = list(range(FRAMES)) if num_frames >= FRAMES else linspace_floor(FRAMES, num_frames)
    video = decode_video(mp4, num_frames=num_frames)
    assert list(video.frames_indices) == expected
    assert [frame_index(f) for f in video.frames] == expected  # the frames are the ones named


@pytest.mark.parametrize("fps, num_frames", [(2, None), (1, None), (0.5, None), (4, 3), (100, None), (0.1, None)])
def test_fps_samples_at_that_rate_capped_by_num_frames(mp4, fps, num_frames):
    # vLLM's rule: n = min(num_frames (32 by default), total, floor(duration * fps)), at least 1
    n = max(1, min(num_frames or 32, FRAMES, math.floor(FRAMES / FPS * fps)))
    expected = list(range(FRAMES)) if n == FRAMES else linspace_floor(FRAMES, n)
    video = decode_video(mp4, fps=fps, num_frames=num_frames)
    assert list(video.frames_indices) == expected
    assert [frame_index(f) for f in video.frames] == expected


def test_the_default_is_32_frames():
    video = decode_video(video_bytes(40, 32, 16, 20))  # the square wraps; only the count is checked
    assert video.frames_indices == tuple(linspace_floor(40, 32)) and video.total_num_frames == 40


@pytest.mark.parametrize("kwargs, match", [
    ({"num_frames": 0}, "num_frames must be"), ({"num_frames": 2.5}, "num_frames must be"),
    ({"num_frames": True}, "num_frames must be"), ({"fps": 0}, "fps must be"), ({"fps": -1}, "fps must be"),
    ({"fps": float("nan")}, "fps must be"), ({"fps": "8"}, "fps must be"),
])  # fmt: skip
def test_bad_sampling_arguments_are_refused(mp4, kwargs, match):
    with pytest.raises(InputError, match=match):
        decode_video(mp4, **kwargs)


# ---- limits ------------------------------------------------------------------------------------


def test_the_byte_limit_is_inclusive(mp4):
    assert decode_video(mp4, MediaPolicy(max_video_bytes=len(mp4)), num_frames=1).num_frames == 1
    with pytest.raises(InputTooLargeError, match=rf"over the size limit of {len(mp4) - 1} bytes \(max_video_bytes\)"):
        decode_video(mp4, MediaPolicy(max_video_bytes=len(mp4) - 1))


@pytest.mark.parametrize("policy, error, match", [
    (MediaPolicy(max_video_duration=1.5), InputTooLargeError,
     r"lasts 2.0 seconds, over the limit of 1.5 seconds \(max_video_duration\)"),
    (MediaPolicy(max_video_decoded_frames=15), InputTooLargeError, r"over 15 frames.*\(max_video_decoded_frames\)"),
    (MediaPolicy(max_video_frame_pixels=WIDTH * HEIGHT - 1), InputTooLargeError,
     r"frames are 64x48 pixels, over the limit of 3071 pixels \(max_video_frame_pixels\)"),
    (MediaPolicy(max_aspect_ratio=1.2), InputError, r"frames are 64x48 pixels, an aspect ratio over the limit of 1.2"),
    (MediaPolicy(min_side=49), InputError, r"frames are 64x48 pixels; frames must be at least 49 pixels"),
])  # fmt: skip
def test_each_limit_is_refused_by_name(mp4, policy, error, match):
    with pytest.raises(error, match=match):
        decode_video(mp4, policy, num_frames=1)


def test_the_limits_hold_at_their_values(mp4):
    policy = MediaPolicy(max_video_duration=2.0, max_video_decoded_frames=16, max_video_frame_pixels=WIDTH * HEIGHT,
                         max_aspect_ratio=WIDTH / HEIGHT, min_side=HEIGHT, max_video_frames=16)  # fmt: skip
    assert decode_video(mp4, policy, num_frames=-1).num_frames == FRAMES


def test_too_many_frames_asked_or_sampled_are_refused(mp4):
    with pytest.raises(InputError, match=r"num_frames=9 is over the limit of 8 frames per video \(max_video_frames\)"):
        decode_video(mp4, MediaPolicy(max_video_frames=8), num_frames=9)
    with pytest.raises(InputError, match=r"would give 16 frames, over the limit of 8 .*\(max_video_frames\)"):
        decode_video(mp4, MediaPolicy(max_video_frames=8), num_frames=-1)
    assert decode_video(mp4, MediaPolicy(max_video_frames=8), num_frames=-1, fps=4).num_frames == 8


@pytest.mark.parametrize("data", [b"", b"definitely not a video" * 10, b"\0\0\0\x18ftypmp42" + b"\0" * 100])
def test_bytes_that_are_not_a_video_are_refused(data):
    with pytest.raises(InputError, match="The video could not be decoded"):
        decode_video(data)
    with pytest.raises(InputError, match="The video could not be decoded"):
        decode_video(data, MediaPolicy(video_formats=None))  # FFmpeg probes any format


def test_an_image_is_a_video_only_for_callers_who_allow_every_format():
    for policy in (MediaPolicy(), LOCAL_FILES):
        with pytest.raises(InputError, match=r"not a video file of a supported format"):
            decode_video(png_bytes(16, 16), policy)
    assert decode_video(png_bytes(16, 16), MediaPolicy(video_formats=None)).frames.shape == (1, 16, 16, 3)


def test_an_unknown_container_names_the_supported_ones():
    with pytest.raises(InputError, match=r"not a video file of a supported format \(MP4, WEBM, AVI\)"):
        decode_video(b"definitely not a video" * 10)
    with pytest.raises(InputError, match=r"supported format \(AVI\)"):
        decode_video(video_bytes(4, WIDTH, HEIGHT, FPS), MediaPolicy(video_formats=("avi",)))


@pytest.mark.parametrize("fraction", [0.1, 0.5, 0.9])
def test_a_truncated_video_is_refused(mp4, fraction):
    with pytest.raises(InputError, match="The video could not be decoded: it is corrupt, truncated"):
        decode_video(mp4[: int(len(mp4) * fraction)])


def test_a_truncated_streamable_video_gives_the_frames_it_has():
    # a Matroska file is readable from its start: cut after some frames, those frames come back
    mkv = video_bytes(FRAMES, WIDTH, HEIGHT, FPS, codec="libx264", container="matroska")
    video = decode_video(mkv[: len(mkv) * 3 // 4], num_frames=-1)
    assert 0 < video.num_frames < FRAMES
    assert [frame_index(f) for f in video.frames] == list(video.frames_indices) == list(range(video.num_frames))


# ---- loading from URLs -------------------------------------------------------------------------


def test_a_video_data_url_loads(mp4):
    url = f"data:video/mp4;base64,{base64.b64encode(mp4).decode()}"
    video = load_video_url(url, num_frames=4)
    assert video.frames_indices == tuple(linspace_floor(FRAMES, 4))
    with pytest.raises(InputTooLargeError, match=f"The video is over the size limit of {len(mp4) - 1} bytes"):
        load_video_url(url, max_video_bytes=len(mp4) - 1)
    with pytest.raises(InputError, match=r"Unsupported media type 'image/png'; send one of video/mp4"):
        load_video_url(url.replace("video/mp4", "image/png"))


def test_a_video_file_loads_under_the_local_file_rules(mp4, tmp_path):
    path = tmp_path / "clip.mp4"
    path.write_bytes(mp4)
    assert load_video_url(str(path), LOCAL_FILES, num_frames=2).num_frames == 2
    assert load_video_url(path.as_uri(), MediaPolicy(allowed_local_dir=tmp_path)).num_frames == FRAMES
    with pytest.raises(InputError, match="Local video files are not read here"):
        load_video_url(str(path))
    with pytest.raises(InputError, match="Video file .*missing.mp4 does not exist"):
        load_video_url(str(tmp_path / "missing.mp4"), LOCAL_FILES)
    with pytest.raises(InputTooLargeError, match="The video is over the size limit"):
        load_video_url(str(path), LOCAL_FILES, max_video_bytes=100)


def test_http_video_urls_follow_the_fetch_rule():
    with pytest.raises(InputError, match=r"http\(s\) video URLs are not fetched here"):
        load_video_url("https://example.com/clip.mp4")


# ---- parsing "video" data ----------------------------------------------------------------------


def parse(**mm_data):
    return MultiModalDataParser().parse_mm_data(mm_data)


@pytest.fixture(scope="module")
def drawn():
    return np.stack([video_frame(i, WIDTH, HEIGHT) for i in range(4)])


VIDEO_FORMS = {
    "array": lambda v: v,
    "pil_list": lambda v: [Image.fromarray(f) for f in v],
    "array_list": lambda v: list(v),
    "video_frames": lambda v: VideoFrames(v, 8.0, 0.5, 4, (0, 1, 2, 3)),
}


@pytest.mark.parametrize("form", VIDEO_FORMS)
def test_the_video_forms_parse_to_one_array(drawn, form):
    videos = parse(video=VIDEO_FORMS[form](drawn)).get_items("video", VideoProcessorItems)
    assert len(videos) == 1 and videos.get_num_frames(0) == 4
    assert videos.get_frame_size(0) == (WIDTH, HEIGHT)
    assert np.array_equal(videos[0], drawn) and videos.get_processor_data()["videos"] == [videos[0]]
    assert (videos.get_metadata(0) is not None) == (form == "video_frames")
    # the HF processor is told the source's frame rate and which frames were kept when they are known
    metadata = videos.get_processor_data().get("video_metadata")
    assert metadata == ([{**VIDEO_FORMS[form](drawn).metadata}] if form == "video_frames" else None)


def test_a_list_of_videos_is_several_items(drawn):
    videos = parse(video=[drawn, [Image.fromarray(f) for f in drawn[:2]], drawn[:3]])["video"]
    assert [videos.get_num_frames(i) for i in range(3)] == [4, 2, 3]
    assert "video" not in parse(video=[])


@pytest.mark.parametrize("data, match", [
    ("clip.mp4", "unsupported type str"),
    (42, "unsupported type int"),
    (["a.mp4"], "Video 0 has unsupported type str"),
    (np.zeros((4, 8, 8, 3), np.float32), r"shape \(4, 8, 8, 3\) and dtype float32; expected a uint8 \[T, H, W, 3\]"),
    (np.zeros((4, 8, 8, 4), np.uint8), "expected a uint8 \\[T, H, W, 3\\]"),
    (np.zeros((8, 8, 3), np.uint8), r"shape \(8, 8, 3\)"),
    (np.zeros((0, 8, 8, 3), np.uint8), "Video 0 has no frames"),
    (np.zeros((2, 2, 8, 3), np.uint8), "frames of 8x2 pixels; frames must be at least 4"),
    ([np.zeros((8, 8, 3), np.uint8), np.zeros((8, 9, 3), np.uint8)], "frames of different sizes"),
    ([np.zeros((8, 8), np.uint8)], r"Video 0 is a numpy array of shape \(8, 8\)"),
    ([np.zeros((8, 8, 1), np.uint8)], r"frame 0 is a numpy array of shape \(8, 8, 1\)"),
])  # fmt: skip
def test_other_video_data_is_refused(data, match):
    with pytest.raises(InputError, match=match):
        parse(video=data)


def video_hash(video):
    return MultiModalHasher.hash_kwargs(model_id="m", modality="video", item=video)


def test_equal_videos_hash_equal_and_different_ones_differ(mp4, drawn):
    as_array = parse(video=drawn)["video"][0]
    as_pil = parse(video=[Image.fromarray(f) for f in drawn])["video"][0]
    assert video_hash(as_array) == video_hash(as_pil) == video_hash(drawn.copy())
    changed = drawn.copy()
    changed[3, 0, 0, 0] ^= 1
    assert video_hash(changed) != video_hash(drawn)
    assert video_hash(drawn[:3]) != video_hash(drawn)
    assert video_hash(decode_video(mp4).frames) == video_hash(decode_video(mp4).frames)
    assert video_hash(decode_video(mp4, num_frames=4).frames) != video_hash(decode_video(mp4, num_frames=5).frames)


def test_a_playlist_is_never_handed_to_ffmpeg():
    playlist = b"#EXTM3U\n#EXT-X-TARGETDURATION:1\n#EXTINF:1,\nfile:///etc/passwd\n#EXT-X-ENDLIST\n"
    for policy in (MediaPolicy(), LOCAL_FILES):
        with pytest.raises(InputError, match="not a video file of a supported format"):
            decode_video(playlist, policy)


# ---- vLLM's data:video/jpeg;base64,<frame>,<frame>,... URLs -------------------------------------


def jpeg_bytes(frame, quality=95):
    buffer = io.BytesIO()
    Image.fromarray(frame).save(buffer, format="JPEG", quality=quality)
    return buffer.getvalue()


JPEG_COUNT = 6


@pytest.fixture(scope="module")
def jpegs():
    return [jpeg_bytes(video_frame(i, WIDTH, HEIGHT)) for i in range(JPEG_COUNT)]


def jpeg_url(frames, header="data:video/jpeg;base64"):
    return header + "," + ",".join(base64.b64encode(f).decode() for f in frames)


def test_a_jpeg_frames_url_is_a_video_of_those_frames(jpegs):
    # vLLM: data.split(",") and each part decoded as a base64 JPEG (PIL, RGB), stacked
    expected = np.stack([np.asarray(Image.open(io.BytesIO(j)).convert("RGB")) for j in jpegs])
    video = load_video_url(jpeg_url(jpegs))
    assert video.frames.dtype == np.uint8 and np.array_equal(video.frames, expected)
    assert video.frames_indices == tuple(range(JPEG_COUNT)) and video.total_num_frames == JPEG_COUNT
    assert [frame_index(f) for f in video.frames] == list(range(JPEG_COUNT))  # in the order sent
    assert video.metadata is None  # no frame rate: as for frames given as an array
    # line-wrapped base64 and upper-case media types read as data URLs do
    wrapped = "data:Video/JPEG;base64," + ",".join(base64.encodebytes(j).decode() for j in jpegs)
    assert np.array_equal(load_video_url(wrapped).frames, expected)


@pytest.mark.parametrize("num_frames, fps", [(2, None), (4, None), (5, None), (100, None), (None, 0.5), (3, 1)])
def test_jpeg_frames_are_sampled_as_a_video_whose_rate_is_unknown(jpegs, num_frames, fps):
    # n = min(num_frames (32 by default), total); with no frame rate, fps cannot cap n
    n = min(num_frames or 32, JPEG_COUNT)
    expected = list(range(JPEG_COUNT)) if n == JPEG_COUNT else linspace_floor(JPEG_COUNT, n)
    video = load_video_url(jpeg_url(jpegs), num_frames=num_frames, fps=fps)
    assert list(video.frames_indices) == expected
    assert [frame_index(f) for f in video.frames] == expected


def test_jpeg_frames_keep_the_video_limits(jpegs):
    url = jpeg_url(jpegs)
    total = sum(map(len, jpegs))
    assert load_video_url(url, max_video_bytes=total).num_frames == JPEG_COUNT  # the limit is inclusive
    with pytest.raises(InputTooLargeError, match=f"The video is over the size limit of {total - 1} bytes"):
        load_video_url(url, max_video_bytes=total - 1)
    with pytest.raises(InputTooLargeError, match="max_video_decoded_frames"):
        load_video_url(url, max_video_decoded_frames=JPEG_COUNT - 1)
    with pytest.raises(InputTooLargeError, match=f"{WIDTH}x{HEIGHT} pixels, over the limit of 100 pixels"):
        load_video_url(url, max_video_frame_pixels=100)
    with pytest.raises(InputError, match="give 6 frames, over the limit of 4 frames"):
        load_video_url(url, max_video_frames=4, num_frames=-1)
    with pytest.raises(InputError, match="num_frames=5 is over the limit of 4"):
        load_video_url(url, max_video_frames=4, num_frames=5)
    assert load_video_url(url, max_video_frames=4, num_frames=4).num_frames == 4


@pytest.mark.parametrize(
    "frames, header, error, match",
    [(lambda j: [j[0], jpeg_bytes(video_frame(1, WIDTH, WIDTH))], None, InputError, "differ in size"),
     (lambda j: [j[0], png_bytes(WIDTH, HEIGHT)], None, InputError, "frame 1 could not be decoded: it is not a JPEG"),
     (lambda j: [j[0], j[1][: len(j[1]) // 2]], None, InputError, "frame 1 could not be decoded"),
     (lambda j: [jpeg_bytes(video_frame(0, 2, 2))], None, InputError, "at least 4 pixels"),
     (lambda j: j[:2], "data:video/jpeg", InputError, "must be base64-encoded"),
     (lambda j: j[:2], "data:video/png;base64", InputError, r"Unsupported media type 'video/png'.*video/jpeg")],
)  # fmt: skip
def test_bad_jpeg_frames_are_clear_input_errors(jpegs, frames, header, error, match):
    with pytest.raises(error, match=match):
        load_video_url(jpeg_url(frames(jpegs), header or "data:video/jpeg;base64"))


@pytest.mark.parametrize(
    "payload, match",
    [("AAAA,,AAAA", "Frame 1 of the video data URL is empty"),
     ("AAAA,not base64!", "Frame 1 of the video data URL is not valid base64")],
)  # fmt: skip
def test_jpeg_frames_that_are_not_base64_are_refused(payload, match):
    with pytest.raises(InputError, match=match):
        load_video_url("data:video/jpeg;base64," + payload)
