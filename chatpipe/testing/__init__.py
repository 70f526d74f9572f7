"""What tests/ and bench/ share: throwaway project copies, a tiny chat model, fuzz cases and servers,
a local hub mirror, the GPU bench's checks. Neither folder imports the other; both import this.

Only tests and benches import it: the rest of the library, stages and flows never do
(tests/test_layering.py), and it runs stages and flows only as commands."""
