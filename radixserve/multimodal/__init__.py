"""Images in, without torch: where an image comes from and whether it may be read (`media`),
what a vision checkpoint expects of one (`spec`), its pixels as the vision tower takes them and
the content hash that names it in the radix tree (`processing`), and the positions of a
prompt's tokens around it (`positions`)."""
