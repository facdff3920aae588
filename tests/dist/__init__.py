"""The distributed tier (a package, so its Ray fixtures end with it: `scope="package"`)."""
