"""The Ray client's router keys the blocks of a prompt with images by the images' content: all
images share the placeholder token ids, so token ids alone would call prompts about different
pictures the same prefix."""

from batchrun.distributed.routing import PrefixRouter, block_hashes, images_key
from batchrun.engine.multimodal import ImageInput, MultiModalInputs


def images(*hashes):
    return MultiModalInputs([ImageInput(h, {}) for h in hashes])


def test_the_same_tokens_with_different_images_are_different_blocks():
    prompt = [7] * 64  # a prompt of placeholders: the same ids whatever the picture
    assert images_key(None) == b""
    assert block_hashes(prompt) == block_hashes(prompt, key=images_key(None))
    red, blue = images_key(images(b"red")), images_key(images(b"blue"))
    assert len({tuple(block_hashes(prompt, key=k)) for k in (b"", red, blue)}) == 3
    assert block_hashes(prompt, key=red) == block_hashes(prompt, key=images_key(images(b"red")))
    assert images_key(images(b"a", b"b")) != images_key(images(b"b", b"a"))


def test_a_repeated_image_goes_where_it_went_and_different_images_spread():
    router = PrefixRouter(2)
    prompt = [7] * 64
    first = router.choose(prompt, images_key(images(b"red")))
    other = router.choose(prompt, images_key(images(b"blue")))  # no match: the least loaded
    assert other != first
    assert router.choose(prompt, images_key(images(b"red"))) == first
