"""The codec-traffic benchmark's count (benchmarks/codec_traffic.py) on 2 gloo ranks.

The compulsory bytes are checked against a hand count for a ``d_out x d_in`` fp32 gradient
``E`` elements, reduce-scatter over 2 ranks, FP8 with one 4-byte scale per chunk: read G (4E),
write this rank's shard (4E / 2), the message written and the received one read (2 chunks of
E / 2 bytes plus a scale each, so E + 8 bytes each way), and the 7 fp32 stats (28 bytes):
8E + 44 bytes. Error feedback adds reading R and writing R' (8E). The codec's kernels must
move at least what they cannot avoid (G read, the shard and the message written), so a count
that missed kernels (a cache hit replays no per-kernel count) fails here."""

from codec_traffic import PATHS, count_all

SHAPE = (64, 32)
E = SHAPE[0] * SHAPE[1]


def test_the_count_matches_a_hand_count(ranks):
    euclidean, with_feedback = (p for p in PATHS if p.name in ("Euclidean FP8", "Euclidean FP8 + EF"))
    for rows in ranks(2).run(count_all, SHAPE, 8, (euclidean, with_feedback)):
        plain, fed = rows
        assert plain["numel"] == E
        assert plain["compulsory"] == 8 * E + 44
        assert fed["compulsory"] == 16 * E + 44
        for row, least in ((plain, 4 * E + 2 * E + E), (fed, 8 * E + 4 * E + 2 * E + E)):
            assert row["split"]["kernel"] >= least
            assert row["split"]["collective"] == 2 * (E + 8)
