"""Test and benchmark support: in-process jobs, fault injection (named by LYCHEE_STEP_HOOK), a throwaway PostgreSQL.
Imported by tests and benchmarks only; may import every layer, and no library module imports it."""
