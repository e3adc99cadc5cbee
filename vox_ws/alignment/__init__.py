"""Word timings for engines that yield none (VoxCPM2): each segment's audio, once complete,
aligned to the text its engine spoke, in worker processes beside the engine.

    spelling.py   the text as words a dictionary knows (numbers, symbols, hyphens spelled out),
                  and which word the client wrote each spoken word belongs to
    sphinx.py     PocketSphinx forced alignment (US English, the model inside its wheel), in a
                  worker process: one decoder per process, made once
    english.py    whether a segment sent without `language` is English (the script, then
                  py3langid): what is not gets estimated times
    pool.py       `WordAligner`: the process pool the service hands segments to
"""
