"""Pass specifications: each test_<pass>.py gives a small Before graph and the Expected graph in the IR's text form."""
