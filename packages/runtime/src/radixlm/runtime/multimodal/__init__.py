"""Images and videos for vision-language models: loading, processing, placing in prompts."""
