"""token_positions: in the batched decode program, ``arange(S) + positions[0]`` (positions derived from the first
one) becomes the positions input itself: token s at position positions[s] (passes/token_positions.py)."""

from dayzero.passes.token_positions import first_position_reads, token_positions

from .ir_spec import assert_ir, ir


def _before(start: int) -> str:
    end = "`seq + 1`" if start else "`seq`"
    return f"""
    graph main symbols(seq in [1, 8]) {{
      %0 = input {{name="cache_position"}} : int64[seq]
      %1 = select.int(%0) {{dim=0, index=0}} : int64[]
      %2 = clone(%1) {{memory_format=null}} : int64[]
      %3 = arange.start_step {{dtype=null, end={end}, start={start}, step=1}} : int64[seq]
      %4 = add.Tensor(%3, %2) {{alpha=1}} : int64[seq]
      %5 = unsqueeze(%4) {{dim=0}} : int64[1, seq]
      return %5
    }}
    """


def test_positions_from_the_first_become_the_positions_input():
    after, found = token_positions(ir(_before(0)), per_token=True)
    assert found.patterns == {"token_positions": 1}
    assert_ir(after, """
    graph main symbols(seq in [1, 8]) {
      %0 = input {name="cache_position"} : int64[seq]
      %1 = unsqueeze(%0) {dim=0} : int64[1, seq]
      return %1
    }
    """)
    assert first_position_reads(after) == []


def test_only_the_batched_decode_program_is_rewritten():
    before = ir(_before(0))
    assert_ir(token_positions(before, per_token=False)[0], before)


def test_an_arange_that_does_not_start_at_zero_is_left_alone():
    before = ir(_before(1))
    after, found = token_positions(before, per_token=True)
    assert_ir(after, before)
    assert found.patterns == {}
    assert {n.op for n in first_position_reads(after)} == {"select.int", "clone"}
