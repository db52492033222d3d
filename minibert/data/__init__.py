"""Chapter 1, the data: WordPiece tokenizer, Megatron's .bin/.idx files, masked-LM samples built as Megatron
builds them (sentence pairs, SOP, masking, the sample index, splits and blends), and the batches the trainer reads."""
